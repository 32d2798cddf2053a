"""Whether speculating pays at all for a batch of this size: measured, not assumed.

Verifying k proposed tokens costs k more query tokens. Where a step is bound by reading the weights
(one sequence on a large model) those tokens are nearly free; where it is bound by compute or by
per-token work (many sequences, a small model) they cost almost as much as decoding them, and a
rejected token is pure loss. So the gate keeps, per batch-size bucket (1, 2, 4, … sequences), the cost
per emitted token (moving averages of a step's seconds and of its emitted tokens) of the pure decode
steps that verified proposals and of those that did not (decode bursts included), and lets a step
speculate while speculating is the cheaper of the two (the engine measures with its process's CPU time
when the model runs in it: load from other processes does not count). Now and then a step tries the
other choice, so both estimates follow the workload: `explore_every` steps after the choice last
changed, then after twice as many steps each time the choice holds, up to 1024 (trying costs: a draft
model that sat idle first catches up on every sequence's tokens). Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_SMOOTHING = 0.1
_MAX_GAP = 1024


@dataclass(slots=True)
class _Cost:
    seconds: float
    tokens: float

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += _SMOOTHING * (seconds - self.seconds)
        self.tokens += _SMOOTHING * (tokens - self.tokens)

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens


@dataclass(slots=True)
class _Bucket:
    spec: _Cost | None = None  # steps that verified proposals
    plain: _Cost | None = None  # steps that did not
    steps: int = 0
    choice: bool | None = None  # the latest preference (True: speculate)
    gap: int = 0  # steps between tries of the other choice
    next_try: int = 0


@dataclass(slots=True)
class SpecGate:
    explore_every: int = 16
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    def allow(self, num_seqs: int) -> bool:
        """Whether a step of `num_seqs` running sequences may speculate."""
        b = self._bucket(num_seqs)
        b.steps += 1
        if b.spec is None:
            # Measure it first, unless the nearest measured size found it dearer: then in a while.
            if self._nearest_prefers_plain(num_seqs):
                if not b.next_try:
                    b.next_try = b.steps + self.explore_every
                return b.steps >= b.next_try
            return True
        cheaper = b.plain is None or b.spec.per_token <= b.plain.per_token
        if cheaper != b.choice:
            b.choice, b.gap = cheaper, self.explore_every
            b.next_try = b.steps + b.gap
        if b.steps >= b.next_try:
            b.gap = min(2 * b.gap, _MAX_GAP)
            b.next_try = b.steps + b.gap
            return not cheaper
        return cheaper

    def observe(self, num_seqs: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A pure decode step of `num_seqs` sequences emitted `tokens` tokens in `seconds`."""
        if tokens <= 0:
            return
        bucket = self._bucket(num_seqs)
        cost = bucket.spec if speculated else bucket.plain
        if cost is None:
            cost = _Cost(seconds, tokens)
            if speculated:
                bucket.spec = cost
            else:
                bucket.plain = cost
        else:
            cost.add(seconds, tokens)

    def costs(self, num_seqs: int) -> tuple[float | None, float | None]:
        """Seconds per emitted token (speculating, not), as measured for this size (None: not yet)."""
        bucket = self._buckets.get(_size(num_seqs))
        if bucket is None:
            return None, None
        return (
            None if bucket.spec is None else bucket.spec.per_token,
            None if bucket.plain is None else bucket.plain.per_token,
        )

    def _nearest_prefers_plain(self, num_seqs: int) -> bool:
        size = _size(num_seqs)
        measured = [
            (abs(k.bit_length() - size.bit_length()), b)
            for k, b in self._buckets.items()
            if b.spec is not None and b.plain is not None
        ]
        if not measured:
            return False
        _, nearest = min(measured, key=lambda m: m[0])
        assert nearest.spec is not None and nearest.plain is not None
        return nearest.spec.per_token > nearest.plain.per_token

    def _bucket(self, num_seqs: int) -> _Bucket:
        return self._buckets.setdefault(_size(num_seqs), _Bucket())


def _size(num_seqs: int) -> int:
    return 1 << max(0, num_seqs - 1).bit_length()
