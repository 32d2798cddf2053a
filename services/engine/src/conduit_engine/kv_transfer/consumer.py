"""The decode side inside the engine loop: a consume request's choices start from their first tokens, wait for
the prompt's KV to be pulled, and then decode like any other sequence.

Plain Python: no torch. `replay_first_tokens` appends each choice's first token through its stop rules
(so max_tokens, penalties, the seeded sampling stream, stop strings held back and the grammar go on
exactly as if the prefill had run here; the text is dropped: the prefill engine released it), then
`KvConsumer.start` plans the pull into the first choice's blocks. The other choices wait for that
choice's prompt like colocated siblings, and reuse its full blocks from the prefix cache. While the pull
runs (on the event loop, through a KvTransport) none of the choices is in the scheduler; `finish` commits
the pulled blocks, or rewinds to the prefix-cache hit so the scheduler recomputes the rest of the prompt
and the first token (identical greedy tokens), and returns the choices to queue.

A request aborted or failed while its pull runs is ended at once, but the first choice keeps its blocks
(the pull may still be writing into them) until `finish` frees them: the blocks stay accounted to a
sequence that `held_sequences` reports for the integrity check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.sequence import FinishReason, Sequence
from conduit_engine.errors import InvalidRequestError, QueueFullError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.params import KvConsume, KvHandleRef
from conduit_engine.kv_transfer.pull_plan import (
    KvPullCounters,
    KvPullPlan,
    abandon_pull,
    commit_pull,
    plan_pull,
)
from conduit_engine.kv_transfer.transport import KvPullResult, KvPullSpec

_FIRST_TOKENS = "kv_transfer.consume.first_tokens"


@dataclass(slots=True)
class PendingPull:
    """A consume request whose prompt KV is being pulled."""

    request_id: str
    plan: KvPullPlan  # into the first choice's blocks
    seqs: list[Sequence]  # every choice, queued when the pull ends
    spec: KvPullSpec
    dest_block_ids: list[int]  # a copy for the event loop: transfer block start_block + i → dest[i]
    orphaned: bool = False  # the request ended meanwhile: free the blocks when the pull ends
    trace_context: object | None = None  # the request's GenerationRequest.trace_context (its pull's span)


def replay_first_tokens(
    consume: KvConsume, seqs: list[Sequence], accept: Callable[[Sequence, int], object]
) -> None:
    """Append each consumed choice's first token through `accept` (the engine's token update: grammar, stop
    rules, detokenizer), as if sampled here (the text
    they release is dropped: the prefill engine sent it). Raises InvalidRequestError for a token that would
    end its choice (the prefill engine ends such a choice itself) or that its grammar refuses."""
    for seq, first in zip(seqs, consume.first_tokens, strict=True):
        accept(seq, first.token_id)
        if seq.is_finished:
            why = (
                "is not allowed by the request's output structure"
                if seq.finish_reason is FinishReason.ERROR
                else "ends the choice by its stop rules (the prefill engine ends such a choice itself)"
            )
            where = f"token {first.token_id} of choice {first.index}"
            raise InvalidRequestError(_FIRST_TOKENS, f"{where} {why}")


class KvConsumer:
    """Consume requests between admission and their first step, over the engine's BlockManager."""

    def __init__(self, block_manager: BlockManager, layout: KvLayoutSpec) -> None:
        self.block_manager = block_manager
        self.layout = layout
        self.counters = KvPullCounters()
        self._pulls: dict[str, PendingPull] = {}

    def pending(self, request_id: str) -> PendingPull | None:
        return self._pulls.get(request_id)

    def held_sequences(self) -> list[Sequence]:
        """The sequences holding blocks a pull writes into (ended requests' included)."""
        return [pull.plan.seq for pull in self._pulls.values()]

    def start(
        self,
        request_id: str,
        handle: KvHandleRef,
        seqs: list[Sequence],
        trace_context: object | None = None,
    ) -> PendingPull:
        """Allocate the pull's blocks for the consumed choices `seqs` (the first pulls, the others wait
        for it), each already holding its first token. Raises QueueFullError when the cache has no room
        now (the caller can try another engine)."""
        plan = plan_pull(self.block_manager, seqs[0], handle.num_tokens)
        if plan is None:
            needed = self.block_manager.blocks_needed(handle.num_tokens)
            raise QueueFullError(
                f"the KV cache has no room for the pulled prompt now ({needed} blocks, "
                f"{self.block_manager.num_free_blocks} free); retry on another engine"
            )
        pending = PendingPull(
            request_id=request_id,
            plan=plan,
            seqs=seqs,
            spec=KvPullSpec(
                handle.source_address,
                handle.transfer_id,
                plan.start_block,
                plan.total_blocks,
                self.layout,
                handle.transports,
            ),
            dest_block_ids=list(plan.dest_block_ids),
            trace_context=trace_context,
        )
        self._pulls[request_id] = pending
        return pending

    def orphan(self, request_id: str) -> Sequence | None:
        """The request ends while its pull may run: returns the sequence whose blocks must stay held
        until `finish` (None when the request is not pulling)."""
        pull = self._pulls.get(request_id)
        if pull is None:
            return None
        pull.orphaned = True
        return pull.plan.seq

    def finish(self, request_id: str, result: KvPullResult | None) -> list[Sequence]:
        """The pull ended (`result`: completed; None: failed or cancelled). Returns the choices to queue:
        none for an orphaned request, whose blocks are freed now."""
        pull = self._pulls.pop(request_id)
        plan = pull.plan
        if pull.orphaned:
            self.block_manager.free(plan.seq)
            return []
        if result is None:
            abandon_pull(self.block_manager, plan)
        else:
            commit_pull(self.block_manager, plan)
            plan.seq.num_pulled_tokens = plan.num_tokens - plan.start_block * self.block_manager.block_size
            self.counters.record(plan, self.layout.block_bytes)
        return pull.seqs
