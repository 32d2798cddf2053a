"""The batched sampler: one call per step turns [B, V] logits into one token (and logprobs) per row.

Pipeline, every stage per row and vectorised over the batch: penalties (bias, min_tokens, repetition,
presence/frequency; see penalties.py) → greedy rows take the argmax → temperature scaling → top-k →
top-p → min-p → random selection by the exponential race: argmax(probs / q) with q ~ Exp(1), which
draws a token with probability `probs` (equivalent to the Gumbel-max trick).

Seeds: a seeded row draws its noise from its own generator seeded by mix_seed(seed, tokens generated
so far), so its tokens depend only on (seed, step) and its own logits — never on the batch around it.
Unseeded rows share one generator seeded from OS entropy, so they vary between runs and processes.

Logprobs are log_softmax of the processed logits after penalties and temperature, before top-k/p/min-p
truncation (vLLM's "processed" mode), so a logprob never reads -inf merely because truncation removed
that token; greedy rows use temperature 1. Prompt logprobs are raw (see logprobs.py).
"""

from __future__ import annotations

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
        # `seed` only fixes the unseeded rows' stream (for reproducible benchmarks); default: OS entropy.
        self._shared_seed = secrets.randbits(64) if seed is None else seed
        self._shared: dict[torch.device, torch.Generator] = {}

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
        elif meta.greedy_mask is None:
            token_ids = self._sample(scaled, meta)
        else:
            token_ids = processed.argmax(dim=-1)
            token_ids[meta.random_rows] = self._sample(scaled[meta.random_rows], meta)

        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_logprobs(scaled, token_ids, meta))

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Draw one token per row of the temperature-scaled logits of the random rows."""
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        logits = apply_min_p(logits, meta.min_p)
        probs = logits.softmax(dim=-1)
        noise = self._exponential_noise(meta.draw_seeds, logits.shape[1], logits.device)
        return probs.div_(noise).argmax(dim=-1)

    def _exponential_noise(
        self, seeds: tuple[int | None, ...], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(len(seeds), vocab_size, dtype=torch.float32, device=device)
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        shared = self._shared_generator(device)
        if len(unseeded) == len(seeds):
            noise.exponential_(generator=shared)
        else:
            if unseeded:
                draws = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device)
                noise[unseeded] = draws.exponential_(generator=shared)
            # The only per-row loop: each seeded row needs its own stream (vLLM does the same).
            for i, seed in enumerate(seeds):
                if seed is not None:
                    generator = torch.Generator(device=device)
                    generator.manual_seed(seed)
                    noise[i].exponential_(generator=generator)
        # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax would pick.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._shared_seed)
            self._shared[device] = generator
        return generator


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
