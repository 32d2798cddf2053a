"""Per-step sampling metadata: turns one batch's sampling plan into the tensors the sampler works on.

The model runner builds one `SamplingMetadata` per step with `metadata_from_plan` (or, from rows,
`build_sampling_metadata`). Everything a batch does not need stays `None`, so the sampler can skip that
work (an all-greedy batch without penalties, bias or logprobs is a plain argmax).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conduit_engine.sampling.plan import NO_LOGPROBS, SamplingPlan, SamplingRow, plan_sampling
from conduit_engine.sampling.seeds import seeded_uniform

__all__ = [
    "SamplingMetadata",
    "SamplingRow",
    "build_sampling_metadata",
    "metadata_from_plan",
    "seeded_uniform",
]


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Tensors (on the logits' device) and small lists describing one batch; `None` = not needed."""

    num_rows: int
    vocab_size: int
    # Rows sampled at random (temperature > 0), as indices into the batch; None when all are greedy.
    random_rows: torch.Tensor | None
    # [B] temperature with greedy rows at 1.0; None when every row would divide by 1.
    temperature: torch.Tensor | None
    # Truncation of the random rows (aligned with random_rows); None when no random row uses it.
    top_k: torch.Tensor | None  # long, vocab_size where disabled
    top_p: torch.Tensor | None  # float, 1.0 where disabled
    min_p: torch.Tensor | None  # float, 0.0 where disabled
    # Uniform draw in [0, 1) of each random row (aligned with random_rows): a pure function of
    # (row seed, tokens generated so far); None for unseeded rows, which the sampler draws itself.
    seeded_uniforms: tuple[float | None, ...]
    # Additive logit bias as sparse (rows, token ids, values); None when no row has a bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (rows, token ids) set to -inf: ids a row must not pick yet (its blocked_token_ids).
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None
    # [B] repetition penalty and [B, V] "token occurs in prompt or output" mask.
    repetition_penalty: torch.Tensor | None
    seen_mask: torch.Tensor | None
    # [B] presence / frequency penalties and [B, V] counts of each token in the output.
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None
    # Per row: how many alternatives to return (None = no logprobs for that row).
    num_logprobs: tuple[int | None, ...]

    @property
    def all_greedy(self) -> bool:
        return self.random_rows is None

    @property
    def all_random(self) -> bool:
        return len(self.seeded_uniforms) == self.num_rows

    @property
    def needs_logprobs(self) -> bool:
        return any(k is not None for k in self.num_logprobs)

    @property
    def has_penalties(self) -> bool:
        return (
            self.logit_bias is not None
            or self.min_tokens_block is not None
            or self.repetition_penalty is not None
            or self.output_counts is not None
        )


def build_sampling_metadata(
    rows: list[SamplingRow], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Collect the per-row parameters of one step into batch tensors on `device`.

    Every token id a row carries was checked against the vocabulary at admission, so nothing here
    depends on the request being well formed.
    """
    if not rows:
        raise ValueError("build_sampling_metadata needs at least one row")
    return metadata_from_plan(plan_sampling(rows), vocab_size, device)


def metadata_from_plan(plan: SamplingPlan, vocab_size: int, device: torch.device) -> SamplingMetadata:
    """The tensors of `plan` on `device` (the plan's token ids were checked at admission)."""
    if plan.num_rows == 0:
        raise ValueError("a sampling plan needs at least one row")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    random_idx = [i for i, t in enumerate(plan.temperature) if t != 0.0]

    def floats(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def longs(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    temperatures = [t if t != 0.0 else 1.0 for t in plan.temperature]
    top_k = [min(plan.top_k[i], vocab_size) if plan.top_k[i] > 0 else vocab_size for i in random_idx]
    top_p = [plan.top_p[i] for i in random_idx]
    min_p = [plan.min_p[i] for i in random_idx]
    rep, presence, frequency = plan.repetition_penalty, plan.presence_penalty, plan.frequency_penalty
    needs_rep = any(r != 1.0 for r in rep)
    needs_counts = any(p != 0.0 for p in presence) or any(f != 0.0 for f in frequency)
    return SamplingMetadata(
        num_rows=plan.num_rows,
        vocab_size=vocab_size,
        random_rows=longs(random_idx) if random_idx else None,
        temperature=floats(temperatures) if any(t != 1.0 for t in temperatures) else None,
        top_k=longs(top_k) if any(k < vocab_size for k in top_k) else None,
        top_p=floats(top_p) if any(p < 1.0 for p in top_p) else None,
        min_p=floats(min_p) if any(p > 0.0 for p in min_p) else None,
        seeded_uniforms=tuple(None if math.isnan(plan.uniforms[i]) else plan.uniforms[i] for i in random_idx),
        logit_bias=(longs(plan.bias_rows), longs(plan.bias_ids), floats(plan.bias_values))
        if plan.bias_rows
        else None,
        min_tokens_block=(longs(plan.blocked_rows), longs(plan.blocked_ids)) if plan.blocked_rows else None,
        repetition_penalty=floats(rep) if needs_rep else None,
        seen_mask=_mask(plan, vocab_size, device) if needs_rep else None,
        presence_penalty=floats(presence) if needs_counts else None,
        frequency_penalty=floats(frequency) if needs_counts else None,
        output_counts=_counts(plan, vocab_size, device) if needs_counts else None,
        num_logprobs=tuple(None if k == NO_LOGPROBS else k for k in plan.num_logprobs),
    )


def _mask(plan: SamplingPlan, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V]: token occurs in the prompt or output of a row with a repetition penalty."""
    mask = torch.zeros(plan.num_rows, vocab_size, dtype=torch.bool, device=device)
    rows = torch.tensor(plan.seen_rows, dtype=torch.long, device=device)
    mask[rows, torch.tensor(plan.seen_ids, dtype=torch.long, device=device)] = True
    return mask


def _counts(plan: SamplingPlan, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V]: how often each token occurs in the output of a row with presence/frequency penalties."""
    counts = torch.zeros(plan.num_rows, vocab_size, dtype=torch.float32, device=device)
    rows = torch.tensor(plan.count_rows, dtype=torch.long, device=device)
    ids = torch.tensor(plan.count_ids, dtype=torch.long, device=device)
    # accumulate=True is a scatter-add: repeated (row, token) pairs add up to the count.
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts
