"""The host side of draft-model proposals (worker/draft_runner.py): the draft's step batches, and the
proposals written into the scheduler's output before the target verifies them. Plain Python: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from conduit_engine.core.scheduler_output import SchedulerOutput
from conduit_engine.core.sequence import Sequence
from conduit_engine.worker.step_inputs import StepBatch


def propose_with_draft(
    out: SchedulerOutput, block_size: int, greedy: Callable[[StepBatch], list[int]]
) -> None:
    """Fill `spec_token_ids` of every scheduled item that asked the draft for `num_draft_tokens` tokens:
    one catch-up pass from what the draft computed of each sequence to its last token, then one decode
    pass per further token, every pass batched over the sequences still proposing."""
    items = [(i, item) for i, item in enumerate(out.scheduled) if item.num_draft_tokens]
    if not items:
        return
    seqs = [item.seq for _, item in items]
    proposals: list[list[int]] = [[] for _ in items]
    proposals_left = [item.num_draft_tokens for _, item in items]
    first = _catch_up_batch(seqs, block_size)
    for j, token in enumerate(greedy(first)):
        proposals[j].append(token)
    while True:
        live = [j for j in range(len(items)) if len(proposals[j]) < proposals_left[j]]
        if not live:
            break
        batch = _decode_batch([seqs[j] for j in live], [proposals[j] for j in live], block_size)
        for j, token in zip(live, greedy(batch), strict=True):
            proposals[j].append(token)
    for (i, item), proposal in zip(items, proposals, strict=True):
        out.scheduled[i] = dataclasses.replace(item, spec_token_ids=tuple(proposal))


def _catch_up_batch(seqs: list[Sequence], block_size: int) -> StepBatch:
    """The tokens from each sequence's num_draft_computed to its last (whose logits give the first
    proposed token)."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    rows: list[int] = []
    for seq in seqs:
        start, end = min(seq.num_draft_computed, seq.num_tokens - 1), seq.num_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        query_lens.append(end - start)
        seq_lens.append(end)
        rows.append(len(input_ids) - 1)
    return _batch(seqs, input_ids, positions, query_lens, seq_lens, rows, block_size)


def _decode_batch(seqs: list[Sequence], proposals: list[list[int]], block_size: int) -> StepBatch:
    """Each sequence's latest proposed token, at the position after the tokens before it."""
    input_ids = [proposal[-1] for proposal in proposals]
    positions = [seq.num_tokens - 1 + len(proposal) for seq, proposal in zip(seqs, proposals, strict=True)]
    seq_lens = [p + 1 for p in positions]
    rows = list(range(len(seqs)))
    return _batch(seqs, input_ids, positions, [1] * len(seqs), seq_lens, rows, block_size)


def _batch(
    seqs: list[Sequence],
    input_ids: list[int],
    positions: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    rows: list[int],
    block_size: int,
) -> StepBatch:
    slots: list[int] = []
    offset = 0
    for seq, q in zip(seqs, query_lens, strict=True):
        table = seq.block_table
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in positions[offset : offset + q]
        )
        offset += q
    width = max(len(seq.block_table) for seq in seqs)
    tables: list[int] = []
    for seq in seqs:
        tables.extend(seq.block_table)
        tables.extend([0] * (width - len(seq.block_table)))
    return StepBatch(input_ids, positions, slots, query_lens, seq_lens, tables, width, rows)
