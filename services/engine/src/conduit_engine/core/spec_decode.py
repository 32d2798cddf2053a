"""Speculative decoding on the scheduler's side: which decoding sequences verify a proposal this step.

Plain Python: no torch. A decoding sequence (one uncomputed token) may carry a proposal of up
to `num_speculative_tokens` tokens (`ScheduledSeq.spec_token_ids`): the step computes its last token and
the proposal (k + 1 query tokens through the paged prefill path), samples every one of those k + 1
positions exactly as a non-speculative step would have sampled it after the tokens before it, and keeps
the sampled tokens up to the first that differs from the proposal (executor/step_batch.py). With a
deterministic proposal that is rejection sampling: a proposed token x is kept with probability p(x), and
a rejected one is replaced by a draw from p without x, so the output is distributed as the target's
(and a seeded row draws the same uniforms as without speculation, so it emits the same tokens).

The proposal counts in the step's token budget and its KV slots are reserved here (without preempting
anyone: no free blocks, no proposal). The KV the model writes for rejected tokens lies past the
sequence's computed tokens: the next step overwrites it, and the prefix cache only hashes computed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.sequence import Sequence
from conduit_engine.speculation.config import SpeculativeConfig
from conduit_engine.speculation.gate import SpecGate
from conduit_engine.speculation.ngram import NgramIndex
from conduit_engine.speculation.tracker import AcceptanceTracker


@dataclass(slots=True)
class SpecDecodeCounters:
    """Totals since start (metrics: conduit_engine_spec_decode_*)."""

    num_drafts: int = 0  # proposals verified
    num_draft_tokens: int = 0  # tokens proposed in them
    num_accepted_tokens: int = 0  # of which accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at proposal position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> SpecDecodeCounters:
        return SpecDecodeCounters(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos)
        )


@dataclass(slots=True)
class _SeqSpec:
    index: NgramIndex
    tracker: AcceptanceTracker


class SpecDecode:
    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.uses_draft = config.method == "draft_model"  # the executor's draft model proposes
        self.config = config
        self._blocks = block_manager
        self._max_model_len = max_model_len
        self._seqs: dict[int, _SeqSpec] = {}
        self.gate = SpecGate()
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def allow(self, num_running: int, pure_decode: bool = True) -> bool:
        """Whether this step may speculate at all (the cost gate; min_acceptance_rate 0: always).
        `pure_decode`: the step looks like one the gate measures (every running sequence decodes one
        token and nobody waits to be admitted)."""
        return self.config.min_acceptance_rate == 0 or self.gate.allow(num_running, pure_decode)

    def propose(self, seq: Sequence, budget: int, keep_free: int = 0) -> tuple[tuple[int, ...], int]:
        """A proposal for `seq`, which decodes one token this step with its slot reserved; at most
        `budget` tokens: (the n-gram proposal, the length of the draft model's proposal), one of them
        empty. Its KV slots are reserved when it is not empty, and only while `keep_free` blocks stay
        free (the other running sequences' next tokens must not need a preemption)."""
        if seq.num_uncomputed_tokens != 1:
            return (), 0
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            return (), 0
        state = self._state(seq)
        if not state.tracker.may_propose():
            return (), 0
        params = seq.params
        limit = min(
            self.config.num_speculative_tokens,
            budget,
            params.max_tokens - seq.num_output_tokens - 1,  # the step emits up to limit + 1 tokens
            self._max_model_len - seq.num_tokens - 1,
        )
        if limit <= 0:
            return (), 0
        proposal = [] if self.uses_draft else state.index.propose(seq.token_ids, limit)
        length = limit if self.uses_draft else len(proposal)
        if not length:
            return (), 0
        blocks = self._blocks
        needed = blocks.blocks_needed(seq.num_computed_tokens + 1 + length) - len(seq.block_table)
        if needed > 0 and blocks.num_free_blocks - needed < keep_free:
            return (), 0  # not enough free blocks for it: decode one token, preempt nobody
        grown = blocks.ensure_slots(seq, seq.num_computed_tokens + 1 + length)
        assert grown, "free blocks were counted before growing"
        return tuple(proposal), (length if self.uses_draft else 0)

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int, computed_before: int) -> None:
        """`seq` verified a proposal of `num_drafts` tokens and `num_accepted` of them were kept; its
        last real token was at `computed_before`."""
        if self.uses_draft:
            # The draft wrote KV up to that token and for the first num_drafts - 1 proposed ones; the
            # accepted ones among them are now the sequence's own.
            seq.num_draft_computed = computed_before + 1 + min(num_accepted, num_drafts - 1)
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.accepted_per_pos[pos] += 1
        state = self._seqs.get(seq.seq_id)
        if state is not None:
            state.tracker.observe(num_drafts, num_accepted)

    def observe_step(self, num_seqs: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A pure decode step of `num_seqs` sequences (`speculated`: some verified a proposal) emitted
        `tokens` tokens in `seconds` of wall time, schedule to update: the gate's measurements."""
        self.gate.observe(num_seqs, speculated, seconds, tokens)

    def forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)

    def acceptance_rate(self, seq: Sequence) -> float | None:
        state = self._seqs.get(seq.seq_id)
        return None if state is None else state.tracker.rate

    def _state(self, seq: Sequence) -> _SeqSpec:
        state = self._seqs.get(seq.seq_id)
        if state is None:
            cfg = self.config
            state = _SeqSpec(
                NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max),
                AcceptanceTracker(cfg.min_acceptance_rate, cfg.acceptance_window),
            )
            self._seqs[seq.seq_id] = state
        return state
