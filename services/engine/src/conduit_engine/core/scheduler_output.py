"""What the scheduler decided for one step: which sequences compute how many tokens, in how many passes,
and which were preempted or admitted. Plain Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from conduit_engine.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for this sequence this step
    # A speculative proposal (core/spec_decode.py): computed after its last token, every position sampled
    # and the sampled tokens kept up to the first that differs from it. Its KV slots are reserved.
    spec_token_ids: tuple[int, ...] = ()
    # Method draft_model: the proposal's length; the executor's draft model fills spec_token_ids.
    num_draft_tokens: int = 0

    @property
    def num_query_tokens(self) -> int:
        """Tokens the model computes for this sequence this step: its new tokens and the proposal."""
        return self.num_new_tokens + max(len(self.spec_token_ids), self.num_draft_tokens)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # scheduled for the first time (not recomputes)
    # Forward passes of this step: 1, or a decode burst's several (every sequence decodes one token per
    # pass, fed the token the pass before sampled; the block tables hold the slots of every pass).
    num_passes: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def num_spec_tokens(self) -> int:
        return sum(max(len(s.spec_token_ids), s.num_draft_tokens) for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed for prompts or recomputed after preemption: all but single-token decodes."""
        return sum(
            s.num_new_tokens
            for s in self.scheduled
            if s.num_new_tokens > 1 or s.seq.num_computed_tokens < s.seq.num_prompt_tokens
        )

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
