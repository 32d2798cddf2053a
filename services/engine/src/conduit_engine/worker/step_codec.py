"""A step as frames (parallel/wire.py): the engine's StepBatch (with its sampling plan and grammar bitmask)
to every worker, and rank 0's StepOutput back.

STEP: integers (table width, has a sampling plan, the bitmask's words per row); int32 arrays for the
token ids, positions, slots, query and context lengths, block tables, logits rows and prompt spans;
the plan's fields in declaration order (float64 for the floats, so the sampler sees the engine's exact
numbers; int32 for the rest); the grammar bitmask (int32 words) and its rows. RESULT: the sampled
token ids, then every TokenLogprobs of the step in one flat table (token, logprob, rank, k, then the
top ids and logprobs back to back), and rank 0's own timings (for the per-step broadcast cost).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from conduit_engine.sampling.grammar_mask import StepBitmask
from conduit_engine.sampling.logprobs import TokenLogprobs
from conduit_engine.sampling.plan import SamplingPlan
from conduit_engine.worker.step_inputs import PromptSpan, StepBatch, StepOutput
from conduit_engine.worker.wire import Array, Frame, Kind, as_array, encode

_PLAN_FIELDS = [(f.name, "d" if f.type == "list[float]" else "i") for f in dataclasses.fields(SamplingPlan)]
_NUM_PLAN = len(_PLAN_FIELDS)


class RankTimings(NamedTuple):
    """Rank 0's view of one step, in nanoseconds: decoding the frame, and from receiving it to sending
    the answer (the rest of the engine's wait is the pipes' latency)."""

    decode_ns: int
    busy_ns: int


# ----- STEP ----------------------------------------------------------------------------------------------
def encode_step(batch: StepBatch, bitmask: StepBitmask | None) -> bytes:
    spans = [v for s in batch.prompt_spans for v in (s.item, s.row, s.k, len(s.targets))]
    targets = [t for s in batch.prompt_spans for t in s.targets]
    arrays: list[Array] = [
        as_array("i", values)
        for values in (
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            batch.query_lens,
            batch.seq_lens,
            batch.block_tables,
            batch.logits_rows,
            spans,
            targets,
        )
    ]
    plan = batch.sampling
    for name, code in _PLAN_FIELDS:
        arrays.append(as_array(code, getattr(plan, name) if plan is not None else ()))
    words = 0
    if bitmask is None:
        arrays += [("i", b""), ("q", b"")]
    else:
        words = bitmask.bitmask.shape[1]
        arrays += [("i", bitmask.bitmask.contiguous().numpy()), ("q", bitmask.rows.contiguous().numpy())]
    arrays.append(as_array("i", batch.lora_slots))
    return encode(Kind.STEP, (batch.table_width, plan is not None, words), arrays)


def decode_step(frame: Frame, device: torch.device) -> tuple[StepBatch, StepBitmask | None]:
    width, has_plan, words = frame.ints
    a = frame.arrays
    flat = a[7].tolist()
    targets = a[8].tolist()
    spans, start = [], 0
    for item, row, k, count in zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4], strict=True):
        spans.append(PromptSpan(item, row, k, targets[start : start + count]))
        start += count
    plan_arrays = a[9 : 9 + _NUM_PLAN]
    plan = SamplingPlan(*(x.tolist() for x in plan_arrays)) if has_plan else None
    batch = StepBatch(
        input_ids=a[0],
        positions=a[1],
        slot_mapping=a[2],
        query_lens=a[3].tolist(),
        seq_lens=a[4].tolist(),
        block_tables=a[5],
        table_width=width,
        logits_rows=a[6],
        prompt_spans=spans,
        sampling=plan,
        lora_slots=a[11 + _NUM_PLAN].tolist(),
    )  # type: ignore[arg-type]  # numpy arrays where the host has lists: the executor takes either
    bitmask = None
    rows = a[10 + _NUM_PLAN]
    if rows.size:
        bits = torch.from_numpy(a[9 + _NUM_PLAN].reshape(rows.size, words)).to(device)
        bitmask = StepBitmask(bitmask=bits, rows=torch.from_numpy(rows).to(device))
    return batch, bitmask


# ----- RESULT --------------------------------------------------------------------------------------------
def encode_result(step: StepOutput, timings: RankTimings) -> bytes:
    entries: list[TokenLogprobs] = []
    row_entry = []
    for lp in step.logprobs:
        row_entry.append(-1 if lp is None else len(entries))
        if lp is not None:
            entries.append(lp)
    span_counts = [len(span) for span in step.prompt_logprobs]
    for span in step.prompt_logprobs:
        entries.extend(span)
    arrays = [
        as_array("i", step.token_ids),
        as_array("i", row_entry),
        as_array("i", span_counts),
        as_array("i", [e.token_id for e in entries]),
        as_array("d", [e.logprob for e in entries]),
        as_array("i", [e.rank for e in entries]),
        as_array("i", [len(e.top_ids) for e in entries]),
        as_array("i", [t for e in entries for t in e.top_ids]),
        as_array("d", [v for e in entries for v in e.top_logprobs]),
    ]
    return encode(Kind.RESULT, timings, arrays)


def decode_result(frame: Frame) -> tuple[StepOutput, RankTimings]:
    token_ids, row_entry, span_counts, ids, values, ranks, ks, top_ids, top_values = (
        x.tolist() for x in frame.arrays
    )
    entries, start = [], 0
    for token_id, value, rank, k in zip(ids, values, ranks, ks, strict=True):
        entries.append(
            TokenLogprobs(token_id, value, rank, top_ids[start : start + k], top_values[start : start + k])
        )
        start += k
    logprobs = [None if i < 0 else entries[i] for i in row_entry]
    prompt, first = [], sum(i >= 0 for i in row_entry)
    for count in span_counts:
        prompt.append(entries[first : first + count])
        first += count
    return StepOutput(token_ids, logprobs, prompt), RankTimings(*frame.ints)
