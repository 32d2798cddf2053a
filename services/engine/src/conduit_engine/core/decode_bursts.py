"""Decode bursts: a step of pure decodes may run several forward passes back to back (multi-step decoding).

On a small model the model's forward pass is a fraction of a step: scheduling, input preparation, the
stop rules, detokenization and the delivery of each token to its stream cost as much again. A burst
schedules once and runs up to `max_decode_steps` forward passes, each feeding the tokens it sampled into
the next, then applies the stop rules to the tokens one by one (tokens after a stop are dropped, as are
their KV writes, which lie past the sequence's end). Plain Python: no torch.

A burst is planned only when every scheduled sequence is decoding (one new token, past its first output
token) and samples without a per-token history: no penalties, no logprobs, no grammar, no `min_tokens`
still holding stops back, no seeded random sampling (a seeded draw depends on the token's position). Its
length is bounded by each sequence's remaining `max_tokens` and context, by the free KV blocks its extra
tokens need (the lookahead, never a preemption), and by time: a burst's passes together take at most
`decode_burst_ms`, measured as a moving average of recent passes. So streams receive tokens in groups
at most that long apart, and a model whose pass alone takes longer never bursts.
"""

from __future__ import annotations

from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.scheduler_output import SchedulerOutput
from conduit_engine.core.sequence import Sequence

# Weight of the newest pass in the moving average of a pass's duration.
_SMOOTHING = 0.2


class DecodeBursts:
    """Decides how many forward passes each step runs, and reserves the KV slots they write."""

    def __init__(
        self, block_manager: BlockManager, max_decode_steps: int, burst_seconds: float, max_model_len: int
    ) -> None:
        self._blocks = block_manager
        self._max_steps = max_decode_steps
        self._burst_seconds = burst_seconds
        self._max_model_len = max_model_len
        self._pass_seconds: float | None = None  # moving average of one forward pass, with sampling
        self.num_bursts = 0  # steps that ran more than one pass
        self.num_burst_passes = 0  # the passes of those steps

    def plan(self, out: SchedulerOutput) -> int:
        """The number of passes for the step `out` (1: an ordinary step). For more than 1, every
        scheduled sequence's block table has grown to hold the burst's tokens."""
        steps = self._steps_allowed_by_time()
        if steps <= 1 or out.preempted or not out.scheduled:
            return 1
        for item in out.scheduled:
            seq = item.seq
            if item.num_query_tokens != 1 or not item.samples or not _history_free(seq):
                return 1
            max_tokens = seq.params.max_tokens
            steps = min(steps, max_tokens - seq.num_output_tokens, self._max_model_len - seq.num_tokens)
            if steps <= 1:
                return 1
        if not self._reserve(out, steps):
            return 1
        self.num_bursts += 1
        self.num_burst_passes += steps
        return steps

    def observe(self, out: SchedulerOutput, seconds: float, passes: int) -> None:
        """The step `out` ran `passes` forward passes (with their sampling) in `seconds`; only steps of
        single-token decodes count towards a pass's duration."""
        if self._max_steps <= 1 or any(item.num_query_tokens != 1 for item in out.scheduled):
            return
        per_pass = seconds / passes
        if self._pass_seconds is None:
            self._pass_seconds = per_pass
        else:
            self._pass_seconds += _SMOOTHING * (per_pass - self._pass_seconds)

    def _steps_allowed_by_time(self) -> int:
        if self._max_steps <= 1 or self._pass_seconds is None:
            return 1  # nothing measured yet: the first decode steps run one pass and are timed
        return max(1, min(self._max_steps, int(self._burst_seconds / max(self._pass_seconds, 1e-9))))

    def _reserve(self, out: SchedulerOutput, steps: int) -> bool:
        """Grow every sequence's block table to hold `steps` more tokens' KV, or change nothing."""
        blocks = self._blocks
        needed = sum(
            max(0, blocks.blocks_needed(item.seq.num_computed_tokens + steps) - len(item.seq.block_table))
            for item in out.scheduled
        )
        if needed > blocks.num_free_blocks:
            return False
        for item in out.scheduled:
            grown = blocks.ensure_slots(item.seq, item.seq.num_computed_tokens + steps)
            assert grown, "free blocks were counted before growing"
        return True


def _history_free(seq: Sequence) -> bool:
    """Whether the sequence's next tokens are sampled the same way whatever came before them."""
    params = seq.params
    return (
        seq.num_output_tokens >= max(1, params.min_tokens)
        and seq.grammar is None
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and (params.temperature == 0.0 or seq.seed is None)
    )
