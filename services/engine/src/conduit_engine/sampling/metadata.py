"""Per-step sampling metadata: turns the rows of one batch into the tensors the sampler works on.

The model runner builds one `SamplingMetadata` per step with `build_sampling_metadata`. Everything a
batch does not need stays `None`, so the sampler can skip that work (an all-greedy batch without
penalties, bias or logprobs is a plain argmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from conduit_engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


class SamplingRow(NamedTuple):
    """One row of the logits batch: one choice of one request at this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # the prompt
    output_token_ids: Sequence[int]  # tokens generated so far (this row's choice only)
    seed: int | None  # effective seed of this row (request seed + choice index), None = unseeded
    # Ids this row must not pick at this step (stop_rules.blocked_token_ids: min_tokens not reached).
    blocked_token_ids: tuple[int, ...] = ()


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


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that a row with `seed` draws at `step`: element `step` of a splitmix64 stream.

    A pure function of (seed, step), so a seeded row's tokens never depend on the batch around it, on
    the device, or on the process. The seed is mixed first so that neighbouring seeds (request seed +
    choice index) start unrelated streams.
    """
    state = (_mix64(seed & _MASK64) + (step + 1) * _GOLDEN_GAMMA) & _MASK64
    return (_mix64(state) >> 11) * 2.0**-53  # top 53 bits: every double in [0, 1) on a 2^-53 grid


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def build_sampling_metadata(
    rows: list[SamplingRow], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Collect the per-row parameters of one step into batch tensors on `device`.

    Every token id a row carries was checked against the vocabulary at admission, so nothing here
    depends on the request being well formed.
    """
    if not rows:
        raise ValueError("build_sampling_metadata needs at least one row")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    params = [row.params for row in rows]
    greedy = [p.is_greedy for p in params]
    random_idx = [i for i, g in enumerate(greedy) if not g]
    random_params = [params[i] for i in random_idx]

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in random_params]
    top_p = [p.top_p for p in random_params]
    min_p = [p.min_p for p in random_params]
    rep = [p.repetition_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    needs_rep = any(r != 1.0 for r in rep)
    needs_counts = any(p != 0.0 for p in presence) or any(f != 0.0 for f in frequency)

    return SamplingMetadata(
        num_rows=len(rows),
        vocab_size=vocab_size,
        random_rows=torch.tensor(random_idx, dtype=torch.long, device=device) if random_idx else None,
        temperature=floats(temperatures) if any(t != 1.0 for t in temperatures) else None,
        top_k=torch.tensor(top_k, dtype=torch.long, device=device)
        if any(k < vocab_size for k in top_k)
        else None,
        top_p=floats(top_p) if any(p < 1.0 for p in top_p) else None,
        min_p=floats(min_p) if any(p > 0.0 for p in min_p) else None,
        seeded_uniforms=tuple(
            None if rows[i].seed is None else seeded_uniform(rows[i].seed, len(rows[i].output_token_ids))
            for i in random_idx
        ),
        logit_bias=_logit_bias(params, device),
        min_tokens_block=_min_tokens_block(rows, device),
        repetition_penalty=floats(rep) if needs_rep else None,
        seen_mask=_seen_mask(rows, rep, vocab_size, device) if needs_rep else None,
        presence_penalty=floats(presence) if needs_counts else None,
        frequency_penalty=floats(frequency) if needs_counts else None,
        output_counts=_output_counts(rows, presence, frequency, vocab_size, device) if needs_counts else None,
        num_logprobs=tuple(p.logprobs for p in params),
    )


def _logit_bias(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    row_idx: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            row_idx.append(i)
            token_ids.append(token_id)
            values.append(float(bias))
    if not row_idx:
        return None
    return (
        torch.tensor(row_idx, dtype=torch.long, device=device),
        torch.tensor(token_ids, dtype=torch.long, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _min_tokens_block(
    rows: list[SamplingRow], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    row_idx: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        row_idx.extend([i] * len(row.blocked_token_ids))
        token_ids.extend(row.blocked_token_ids)
    if not row_idx:
        return None
    return (
        torch.tensor(row_idx, dtype=torch.long, device=device),
        torch.tensor(token_ids, dtype=torch.long, device=device),
    )


def _seen_mask(
    rows: list[SamplingRow], rep: list[float], vocab_size: int, device: torch.device
) -> torch.Tensor:
    row_idx, token_ids = _flatten(
        [
            (list(row.prompt_token_ids) + list(row.output_token_ids)) if r != 1.0 else []
            for row, r in zip(rows, rep, strict=True)
        ],
        device,
    )
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    mask[row_idx, token_ids] = True
    return mask


def _output_counts(
    rows: list[SamplingRow],
    presence: list[float],
    frequency: list[float],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    row_idx, token_ids = _flatten(
        [
            row.output_token_ids if (p != 0.0 or f != 0.0) else []
            for row, p, f in zip(rows, presence, frequency, strict=True)
        ],
        device,
    )
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    # accumulate=True is a scatter-add: repeated (row, token) pairs add up to the count.
    counts.index_put_((row_idx, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
    return counts


def _flatten(per_row: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of every token of every row, as two long tensors."""
    row_idx: list[int] = []
    token_ids: list[int] = []
    for i, ids in enumerate(per_row):
        row_idx.extend([i] * len(ids))
        token_ids.extend(ids)
    return (
        torch.tensor(row_idx, dtype=torch.long, device=device),
        torch.tensor(token_ids, dtype=torch.long, device=device),
    )
