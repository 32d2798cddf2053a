"""The batched sampler: one call per step turns [B, V] logits into one token (and logprobs) per row.

Pipeline, every stage per row and vectorised over the batch: penalties (bias, min_tokens, repetition,
presence/frequency; see penalties.py) → greedy rows take the argmax → temperature scaling → top-k →
top-p → min-p → random selection by inverse CDF: the first token whose cumulative probability
(float64) exceeds the row's uniform draw u ∈ [0, 1). One uniform per row rather than one noise value
per vocabulary entry (the exponential race) keeps a step cheap on CPU, where noise over 32k entries
per row would cost more than the softmax itself.

Seeds: a seeded row's uniform is a pure function of (seed, tokens generated so far) (see
metadata.seeded_uniform), so its tokens never depend on the batch, the row's place in it, or the
device. Unseeded rows draw from one generator per Sampler seeded from OS entropy, so they vary between
runs and processes.

Logprobs are log_softmax of the processed logits after penalties and temperature, before top-k/p/min-p
truncation (vLLM's "processed" mode), so a logprob never reads -inf merely because truncation removed
that token; greedy rows use temperature 1. Prompt logprobs are raw (see logprobs.py).
"""

from __future__ import annotations

import random
import secrets
from typing import NamedTuple

import torch

from conduit_engine.sampling.logprobs import TokenLogprobs, compute_prompt_logprobs, gather_logprobs
from conduit_engine.sampling.metadata import SamplingMetadata
from conduit_engine.sampling.penalties import apply_penalties
from conduit_engine.sampling.truncation import apply_min_p, apply_top_k_top_p

__all__ = ["Sampler", "SamplerOutput", "TokenLogprobs", "compute_prompt_logprobs"]


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where the row asked for none


class Sampler:
    """Stateless apart from the shared generator that unseeded rows draw from."""

    def __init__(self, seed: int | None = None) -> None:
        # `seed` only fixes the unseeded rows' stream (reproducible benchmarks); default: OS entropy.
        self._unseeded = random.Random(secrets.randbits(64) if seed is None else seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the metadata "
                f"({meta.num_rows} rows, vocabulary {meta.vocab_size})"
            )
        processed = apply_penalties(logits.float(), meta)
        scaled = processed if meta.temperature is None else processed / meta.temperature.unsqueeze(1)

        if meta.random_rows is None:
            token_ids = processed.argmax(dim=-1)
        elif meta.all_random:
            token_ids = self._sample(scaled, meta)
        else:
            token_ids = processed.argmax(dim=-1)
            token_ids[meta.random_rows] = self._sample(scaled[meta.random_rows], meta)

        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_logprobs(scaled, token_ids, meta))

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Draw one token per row of the temperature-scaled logits of the random rows."""
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        logits = apply_min_p(logits, meta.min_p)
        uniforms = [self._unseeded.random() if u is None else u for u in meta.seeded_uniforms]
        return sample_inverse_cdf(logits, torch.tensor(uniforms, dtype=torch.float64, device=logits.device))


def sample_inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds uniforms[i] (in [0, 1)).

    A token at -inf has probability exactly 0, so the cumulative sum does not rise there and the
    search never lands on it.
    """
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # float64: the tail of a 32k sum stays exact enough
    total = cdf[:, -1:]
    # Scale to the row's actual total (rounding leaves it a hair off 1) and stay strictly below it.
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    token_ids = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[1] - 1)
    # A parallel scan (CUDA) may round a zero-probability step differently; never return such a token.
    chosen = probs.gather(1, token_ids)
    token_ids = torch.where(chosen > 0, token_ids, probs.argmax(dim=-1, keepdim=True))
    return token_ids.squeeze(1)


def _logprobs(
    scaled: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata
) -> list[TokenLogprobs | None]:
    result: list[TokenLogprobs | None] = [None] * meta.num_rows
    if not meta.needs_logprobs:
        return result
    rows = [i for i, k in enumerate(meta.num_logprobs) if k is not None]
    ks = [k for k in meta.num_logprobs if k is not None]
    index = torch.tensor(rows, dtype=torch.long, device=scaled.device)
    logprobs = torch.log_softmax(scaled[index], dim=-1)
    for row, entry in zip(rows, gather_logprobs(logprobs, token_ids[index], ks), strict=True):
        result[row] = entry
    return result
