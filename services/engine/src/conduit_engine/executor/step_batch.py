"""One step on the host side: the scheduler's output as flat integer lists, and the results back per sequence.

Plain Python (no torch): `build_step` turns a SchedulerOutput into the numbers a model shard needs (token
ids, positions, cache slots, query/context lengths, padded block tables, the rows to sample, the prompt
spans whose logprobs were asked for, and the sampling plan: a `worker.step_inputs.StepBatch`);
`collect_results` gives each scheduled sequence its part of the sampling rank's `StepOutput`, and
`collect_passes` its tokens of a multi-pass step. The in-process executor hands the StepBatch to its
ModelRunner directly; the multi-process one sends it to the worker processes first (`worker/step_codec.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from conduit_engine.core.scheduler_output import SchedulerOutput
from conduit_engine.core.sequence import Sequence
from conduit_engine.core.stop_rules import blocked_token_ids
from conduit_engine.sampling.plan import SamplingRow, plan_sampling
from conduit_engine.worker.step_inputs import PromptSpan, StepBatch, StepOutput

if TYPE_CHECKING:
    from conduit_engine.sampling.logprobs import TokenLogprobs
    from conduit_engine.structured.state import GrammarState


@dataclass(slots=True)
class SeqStepResult:
    """What one step gave a scheduled sequence: its sampled tokens (none before the end of a prefill, one
    per pass otherwise), their logprobs when asked for, and the prompt logprobs of the positions computed."""

    seq: Sequence
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


def build_step(
    out: SchedulerOutput, block_size: int, eos_token_ids: tuple[int, ...]
) -> tuple[StepBatch, list[Sequence]]:
    """The StepBatch of `out`, and the sequences sampled this step (in logits-row order)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    sampling_seqs: list[Sequence] = []
    rows: list[SamplingRow] = []
    for item in out.scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        spec = item.spec_token_ids
        end = start + item.num_new_tokens + len(spec)
        input_ids.extend(seq.token_ids[start : start + item.num_new_tokens])
        input_ids.extend(spec)
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_lens.append(end - start)
        seq_lens.append(end)
        if item.samples:
            # A proposal's k tokens: every position from the last real token on is sampled, as the
            # non-speculative steps would sample it after the proposal tokens before it.
            for j in range(len(spec) + 1):
                logits_rows.append(len(input_ids) - 1 - len(spec) + j)
                sampling_seqs.append(seq)
                rows.append(_sampling_row(seq, eos_token_ids, spec[:j]))
    width = max((len(item.seq.block_table) for item in out.scheduled), default=0)
    tables: list[int] = []
    for item in out.scheduled:
        tables.extend(item.seq.block_table)
        tables.extend([0] * (width - len(item.seq.block_table)))
    batch = StepBatch(input_ids, positions, slots, query_lens, seq_lens, tables, width, logits_rows)
    batch.prompt_spans = _prompt_spans(out)
    if rows:
        batch.sampling = plan_sampling(rows)
    return batch, sampling_seqs


def _sampling_row(
    seq: Sequence, eos_token_ids: tuple[int, ...], proposed: tuple[int, ...] = ()
) -> SamplingRow:
    """The row that samples `seq`'s next token, after the `proposed` tokens when it verifies a proposal."""
    output = seq.output_token_ids
    if proposed:
        output = output + list(proposed)
    return SamplingRow(
        params=seq.params,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=output,
        seed=seq.seed,
        blocked_token_ids=blocked_token_ids(seq.params, eos_token_ids, len(output)),
    )


def _prompt_spans(out: SchedulerOutput) -> list[PromptSpan]:
    spans: list[PromptSpan] = []
    offset = 0
    for index, item in enumerate(out.scheduled):
        seq, start = item.seq, item.seq.num_computed_tokens
        k = seq.params.prompt_logprobs
        # Positions start..end-1 predict tokens start+1..end; only prompt targets count.
        end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
        if k is not None and seq.num_output_tokens == 0 and end > start:
            spans.append(PromptSpan(index, offset, k, seq.prompt_token_ids[start + 1 : end + 1]))
        offset += item.num_new_tokens
    return spans


class _GrammarRow(NamedTuple):
    grammar: GrammarState | None


def mask_rows(out: SchedulerOutput, sampling_seqs: list[Sequence]) -> list[Sequence | _GrammarRow]:
    """What the step's grammar bitmask reads per logits row (`structured.batch_mask.SequenceMasks`):
    the sampled sequence, or for the k + 1 rows of a constrained sequence verifying a proposal, the
    grammar state after the proposal's first j tokens (forks; a proposed token the grammar rejects
    ends the forks there: the row before it cannot sample it, so the later rows are never kept)."""
    if not any(item.spec_token_ids and item.seq.grammar is not None for item in out.scheduled):
        return list(sampling_seqs)
    rows: list[Sequence | _GrammarRow] = []
    for item in out.scheduled:
        if not item.samples:
            continue
        seq, spec = item.seq, item.spec_token_ids
        if not spec or seq.grammar is None:
            rows.extend([seq] * (len(spec) + 1))
            continue
        state = seq.grammar
        rows.append(seq)
        for token_id in spec:
            twin = state.fork()
            if twin.accept(token_id):
                state = twin
            rows.append(_GrammarRow(state))
    assert len(rows) == len(sampling_seqs)
    return rows


def collect_results(
    out: SchedulerOutput, batch: StepBatch, sampling_seqs: list[Sequence], step: StepOutput
) -> list[SeqStepResult]:
    """One result per scheduled sequence, in schedule order."""
    results = [SeqStepResult(item.seq) for item in out.scheduled]
    for span, logprobs in zip(batch.prompt_spans, step.prompt_logprobs, strict=True):
        results[span.item].prompt_logprobs = logprobs
    by_seq = {id(r.seq): r for r in results}
    for seq, token_id, logprobs in zip(sampling_seqs, step.token_ids, step.logprobs, strict=True):
        result = by_seq[id(seq)]
        result.token_ids.append(token_id)
        if logprobs is not None:
            result.logprobs.append(logprobs)
    for item, result in zip(out.scheduled, results, strict=True):
        if item.spec_token_ids and result.token_ids:
            verify(result, item.spec_token_ids)
    return results


def verify(result: SeqStepResult, proposal: tuple[int, ...]) -> None:
    """Keep the tokens sampled at a proposal's k + 1 positions up to the first that differs from the
    proposal (the sampled one replaces it), or all k + 1 when every proposed token was sampled.

    Position j was sampled from the target's distribution p_j given the tokens before it (the proposal's
    first j), so keeping proposed token x exactly when the draw is x accepts it with probability p_j(x),
    and a differing draw is distributed as p_j without x, renormalised: the rejection sampling of the
    speculative sampling papers for a deterministic proposal (q = one-hot), and, greedy, the argmax."""
    keep = len(proposal) + 1
    for j, token_id in enumerate(proposal):
        if result.token_ids[j] != token_id:
            keep = j + 1
            break
    del result.token_ids[keep:]
    del result.logprobs[keep:]


def collect_passes(out: SchedulerOutput, tokens: list[list[int]]) -> list[SeqStepResult]:
    """One result per scheduled sequence of a multi-pass step: `tokens` holds each pass's tokens (one per
    sequence, in schedule order); a sequence gets one token of every pass."""
    per_seq = zip(*tokens, strict=True)
    return [SeqStepResult(item.seq, list(row)) for item, row in zip(out.scheduled, per_seq, strict=True)]
