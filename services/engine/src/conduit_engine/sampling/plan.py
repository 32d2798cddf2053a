"""One step's sampling parameters as flat numbers: what the sampler needs of every row, and nothing else.

`plan_sampling(rows)` reads the rows' SamplingParams, token histories and seeds once, on the host,
into lists of plain numbers (no torch, no Python objects): the form that crosses to a worker process
(parallel/step_codec.py) and the form `metadata.metadata_from_plan` turns into tensors on the logits'
device. A seeded row's uniform draw is computed here, from (seed, tokens generated so far), so it is
the same number whichever process samples and whatever batch the row is in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from conduit_engine.sampling.seeds import seeded_uniform

if TYPE_CHECKING:
    from conduit_engine.sampling_params import SamplingParams

UNSEEDED = math.nan  # the uniform of a row the sampler draws itself (unseeded, or greedy)
NO_LOGPROBS = -1


class SamplingRow(NamedTuple):
    """One row of the logits batch: one choice of one request at this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # the prompt
    output_token_ids: Sequence[int]  # tokens generated so far (this row's choice only)
    seed: int | None  # effective seed of this row (request seed + choice index), None = unseeded
    # Ids this row must not pick at this step (stop_rules.blocked_token_ids: min_tokens not reached).
    blocked_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """Per row (index i of every per-row list): temperature (0 = greedy), top_k (0 = off), top_p,
    min_p, the seeded uniform (UNSEEDED = NaN: drawn by the sampler), the three penalties, how many
    logprobs (NO_LOGPROBS = -1: none). Sparse per-token entries as parallel (row, token id[, value])
    lists: logit bias, blocked ids, tokens seen in prompt or output (rows with a repetition penalty),
    output tokens (rows with presence/frequency penalties; repeated ids count)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    uniforms: list[float]
    repetition_penalty: list[float]
    presence_penalty: list[float]
    frequency_penalty: list[float]
    num_logprobs: list[int]
    bias_rows: list[int]
    bias_ids: list[int]
    bias_values: list[float]
    blocked_rows: list[int]
    blocked_ids: list[int]
    seen_rows: list[int]
    seen_ids: list[int]
    count_rows: list[int]
    count_ids: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.temperature)


def plan_sampling(rows: Sequence[SamplingRow]) -> SamplingPlan:
    """The plan of `rows`, in order."""
    params = [row.params for row in rows]
    bias = [(i, t, float(v)) for i, p in enumerate(params) if p.logit_bias for t, v in p.logit_bias.items()]
    blocked = [(i, t) for i, row in enumerate(rows) for t in row.blocked_token_ids]
    seen: tuple[list[int], list[int]] = ([], [])
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _pairs(
            (list(row.prompt_token_ids) + list(row.output_token_ids))
            if row.params.repetition_penalty != 1.0
            else ()
            for row in rows
        )
    counts: tuple[list[int], list[int]] = ([], [])
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = _pairs(
            row.output_token_ids if (row.params.presence_penalty or row.params.frequency_penalty) else ()
            for row in rows
        )
    return SamplingPlan(
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        # A seeded row's draw; greedy rows draw nothing.
        uniforms=[
            UNSEEDED
            if row.seed is None or p.temperature == 0.0
            else seeded_uniform(row.seed, len(row.output_token_ids))
            for row, p in zip(rows, params, strict=True)
        ],
        repetition_penalty=[p.repetition_penalty for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        num_logprobs=[NO_LOGPROBS if p.logprobs is None else p.logprobs for p in params],
        bias_rows=[b[0] for b in bias],
        bias_ids=[b[1] for b in bias],
        bias_values=[b[2] for b in bias],
        blocked_rows=[b[0] for b in blocked],
        blocked_ids=[b[1] for b in blocked],
        seen_rows=seen[0],
        seen_ids=seen[1],
        count_rows=counts[0],
        count_ids=counts[1],
    )


def _pairs(per_row: Iterable[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(row index, token id) of every token of every row."""
    row_idx: list[int] = []
    token_ids: list[int] = []
    for i, ids in enumerate(per_row):
        row_idx.extend([i] * len(ids))
        token_ids.extend(ids)
    return row_idx, token_ids
