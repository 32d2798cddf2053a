"""The destination side of a KV transfer: which blocks to pull, and committing them once written.

Plain Python: no torch. A consume request's choice is a Sequence whose tokens are the prompt followed by
the first token the prefill engine sampled (appended as output). `plan_pull` gives it blocks as a first
admission would: the longest prefix already in this engine's prefix cache is taken as is (those blocks
are not pulled: `start_block`), and fresh blocks hold the rest of the prompt. The caller pulls transfer
blocks [start_block, total_blocks) into `dest_block_ids`, then calls `commit_pull`: the prompt counts as
computed and its full blocks enter the prefix cache, so the next step computes the first token and
decoding goes on as if the prompt had been prefilled here. If the pull fails, `abandon_pull` keeps the
blocks but rewinds to the prefix-cache hit, and the scheduler recomputes the rest of the prompt plus the
first token like any prefill (the half-written blocks belong to this sequence alone and carry no hash).
"""

from __future__ import annotations

from dataclasses import dataclass

from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.sequence import Sequence
from conduit_engine.errors import InvalidRequestError


@dataclass(slots=True)
class KvPullPlan:
    """Where one transfer's blocks go in this engine's cache."""

    seq: Sequence
    num_tokens: int  # prompt tokens whose KV the transfer holds
    start_block: int  # first transfer block to pull; earlier ones were prefix-cache hits here
    total_blocks: int  # blocks of the transfer

    @property
    def dest_block_ids(self) -> list[int]:
        """Cache blocks receiving transfer blocks start_block, start_block + 1, ..., total_blocks - 1."""
        return self.seq.block_table[self.start_block : self.total_blocks]

    @property
    def num_pull_blocks(self) -> int:
        return self.total_blocks - self.start_block


def plan_pull(block_manager: BlockManager, seq: Sequence, num_tokens: int) -> KvPullPlan | None:
    """Allocate `seq`'s blocks for a pull of its prompt's KV (`num_tokens`, from the KvHandle).

    Returns None, holding nothing, when the cache has too few free blocks now (the caller refuses the
    request or waits). A sequence owing prompt logprobs takes no prefix hit (see `allocate_prefix`).
    """
    if seq.num_prompt_tokens != num_tokens:
        raise InvalidRequestError(
            "kv_transfer.consume.handle.num_tokens",
            f"the handle holds {num_tokens} tokens but the prompt has {seq.num_prompt_tokens}",
        )
    if seq.num_output_tokens != 1 or seq.block_table:
        raise ValueError("seq: expected a new sequence holding its prompt and exactly its first token")
    cached_tokens = block_manager.allocate_prefix(seq)
    if not block_manager.ensure_slots(seq, num_tokens):
        block_manager.free(seq)
        return None
    return KvPullPlan(
        seq=seq,
        num_tokens=num_tokens,
        start_block=cached_tokens // block_manager.block_size,
        total_blocks=block_manager.blocks_needed(num_tokens),
    )


def commit_pull(block_manager: BlockManager, plan: KvPullPlan) -> None:
    """Every transfer block is written: the prompt is computed and its full blocks are prefix-cached."""
    plan.seq.num_computed_tokens = plan.num_tokens
    block_manager.commit_computed_blocks(plan.seq)


def abandon_pull(block_manager: BlockManager, plan: KvPullPlan) -> None:
    """The pull failed: recompute from the end of the prefix-cache hit (the recompute fallback)."""
    plan.seq.num_computed_tokens = plan.start_block * block_manager.block_size


@dataclass(slots=True)
class KvPullCounters:
    """GetLoad's kv_bytes_pulled and kv_bytes_saved since start, and the committed pulls."""

    bytes_pulled: int = 0
    bytes_saved: int = 0  # blocks already in the prefix cache, not pulled
    pulls: int = 0

    def record(self, plan: KvPullPlan, block_bytes: int) -> None:
        """Count one committed pull."""
        self.pulls += 1
        self.bytes_pulled += plan.num_pull_blocks * block_bytes
        self.bytes_saved += plan.start_block * block_bytes
