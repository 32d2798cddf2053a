"""Whether speculating pays at all for a batch of this size: measured, not assumed.

Verifying k proposed tokens costs k more query tokens. Where a step is bound by reading the weights
(one sequence on a large model) those tokens are nearly free; where it is bound by compute or by
per-token work (many sequences, a small model) they cost almost as much as decoding them, and a
rejected token is pure loss. So the gate keeps, per batch-size bucket (1, 2, 4, … sequences), the cost
per emitted token (moving averages of a step's seconds and of its emitted tokens) of the pure decode
steps that verified proposals and of those that did not (decode bursts included), and lets a step
speculate while speculating is the cheaper of the two (the engine measures with its process's CPU time
when the model runs in it: load from other processes does not count). The first measurement of a size
is followed at once by one of the other choice, so the gate picks from both. Now and then a step tries
the other choice, so both estimates follow the workload: `explore_every` steps after the choice last
changed, then after twice as many steps each time the choice holds, up to 1024; and never sooner than
the latest try's cost allows, so that trying loses at most 2% of the time between tries (a try costs
what it took beyond what the preferred choice takes for the tokens it emitted, counted in the
preferred choice's steps: a draft model that sat idle first catches up on every sequence's tokens,
which can make one try cost several steps). Steps with prefill work are not measured, so they
neither measure nor try: they follow the preference. Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_SMOOTHING = 0.1
_MAX_GAP = 1024
_TRY_LOSS = 0.02  # at most this share of the steps between tries is lost to trying the dearer choice


@dataclass(slots=True)
class _Cost:
    seconds: float
    tokens: float
    samples: int = 1

    def add(self, seconds: float, tokens: int) -> None:
        # The plain mean of the first samples, then a moving average: a first step that was slow for
        # its own reasons (a shape run for the first time) does not stand for ten more.
        self.samples += 1
        weight = max(_SMOOTHING, 1 / self.samples)
        self.seconds += weight * (seconds - self.seconds)
        self.tokens += weight * (tokens - self.tokens)

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
    try_loss: float = 0.0  # what the latest try cost beyond the preferred choice, in its steps


@dataclass(slots=True)
class SpecGate:
    explore_every: int = 16
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    def allow(self, num_seqs: int, measured: bool = True) -> bool:
        """Whether a step of `num_seqs` running sequences may speculate. A step that will not be
        `measured` (it has prefill work: observe() never sees it) follows the preference: it neither
        measures nor tries, which would cost without telling anything."""
        b = self._bucket(num_seqs)
        if not measured:
            if b.spec is not None and b.plain is not None:
                return b.spec.per_token <= b.plain.per_token
            return not self._nearest_prefers_plain(num_seqs)
        b.steps += 1
        if b.spec is None:
            # Measure it first, unless the nearest measured size found it dearer: then in a while.
            if self._nearest_prefers_plain(num_seqs):
                if not b.next_try:
                    b.next_try = b.steps + self.explore_every
                return b.steps >= b.next_try
            return True
        if b.plain is None:
            return False  # measure the other choice at once: the gate picks from both
        cheaper = b.spec.per_token <= b.plain.per_token
        if cheaper != b.choice:
            b.choice, b.gap = cheaper, _gap(b, self.explore_every)
            b.next_try = b.steps + b.gap
        if b.steps >= b.next_try:
            b.gap = _gap(b, 2 * b.gap)
            b.next_try = b.steps + b.gap
            return not cheaper
        return cheaper

    def observe(self, num_seqs: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A pure decode step of `num_seqs` sequences emitted `tokens` tokens in `seconds`."""
        if tokens <= 0:
            return
        bucket = self._bucket(num_seqs)
        if bucket.choice is not None and speculated != bucket.choice:
            preferred = bucket.spec if bucket.choice else bucket.plain
            if preferred is not None:
                # A dear try moves the next one out at once (allow() set it before the cost was known).
                bucket.try_loss = _loss(seconds, tokens, preferred)
                bucket.gap = _gap(bucket, bucket.gap)
                bucket.next_try = bucket.steps + bucket.gap
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


def _gap(bucket: _Bucket, steps: int) -> int:
    """`steps`, or more where the latest try lost more than _TRY_LOSS of that many steps."""
    return min(_MAX_GAP, max(steps, math.ceil(bucket.try_loss / _TRY_LOSS)))


def _loss(seconds: float, tokens: float, preferred: _Cost) -> float:
    """What a step of `seconds` emitting `tokens` took beyond the `preferred` choice's time for as many
    tokens, in steps of the preferred choice (0 when it was no dearer)."""
    return max(0.0, (seconds - tokens * preferred.per_token) / preferred.seconds)


def _size(num_seqs: int) -> int:
    return 1 << max(0, num_seqs - 1).bit_length()
