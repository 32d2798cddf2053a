"""Rotary position embedding: the cos|sin table of every position, in float32, as transformers computes it.

Static scalings (default, linear, llama3, yarn) use one set of frequencies for every position. The two
that transformers recomputes from the sequence length (dynamic NTK, longrope) are given here per
position: position p uses the frequencies transformers uses when it decodes the token at p one at a
time (sequence length p + 1). So a position's rotation never depends on how a step batches or chunks
tokens, KV computed once stays valid, and greedy parity with transformers holds whenever the prompt
fits the original context (transformers rotates a longer prompt, prefilled in one call, with the
frequencies of its full length instead).
"""

from __future__ import annotations

import math

import torch

from conduit_engine.models.config import ArchConfig
from conduit_engine.models.rope_config import RopeScaling


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, ramp in between; scale cos/sin."""
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


def _dynamic(theta: float, dim: int, s: RopeScaling, max_pos: int, positions: torch.Tensor) -> torch.Tensor:
    """[P, dim/2]: NTK-scaled frequencies for a sequence of length p + 1 once it exceeds max_pos."""
    original = 1.0 / (theta * ((s.factor * max_pos / max_pos) - (s.factor - 1)) ** (dim / (dim - 2))) ** (
        _exponents(dim)
    )
    seq_len = torch.maximum(positions + 1, torch.tensor(max_pos))
    base = theta * ((s.factor * seq_len / max_pos) - (s.factor - 1)) ** (dim / (dim - 2))
    scaled = 1.0 / (base.unsqueeze(1) ** _exponents(dim).unsqueeze(0))
    return torch.where((positions + 1 > max_pos).unsqueeze(1), scaled, original.unsqueeze(0))


def _longrope(theta: float, dim: int, s: RopeScaling, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """[P, dim/2]: short factors within the original context, long ones beyond it."""
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.factor <= 1.0:
        attention = 1.0
    else:
        attention = math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    powers = theta ** _exponents(dim)
    short = 1.0 / (torch.tensor(s.short_factor, dtype=torch.float32) * powers)
    long = 1.0 / (torch.tensor(s.long_factor, dtype=torch.float32) * powers)
    beyond = (positions + 1 > s.original_max_position_embeddings).unsqueeze(1)
    return torch.where(beyond, long.unsqueeze(0), short.unsqueeze(0)), attention


def frequencies(config: ArchConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """([P, head_dim/2] inverse frequencies of each position, cos/sin multiplier)."""
    theta, dim, s = config.rope_theta, config.head_dim, config.rope_scaling
    positions = torch.arange(max_positions, dtype=torch.int64)
    if s.rope_type == "dynamic":
        return _dynamic(theta, dim, s, config.max_position_embeddings, positions), 1.0
    if s.rope_type == "longrope":
        return _longrope(theta, dim, s, positions)
    attention = 1.0
    if s.rope_type == "yarn":
        inv, attention = _yarn(theta, dim, s)
    else:
        inv = _default(theta, dim)
        if s.rope_type == "linear":
            inv = inv / s.factor
        elif s.rope_type == "llama3":
            inv = _llama3(inv, s)
    return inv.unsqueeze(0).expand(max_positions, -1), attention


def cos_sin_cache(config: ArchConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the half-frequencies, then their sin."""
    inv, attention = frequencies(config, max_positions)
    freqs = torch.arange(max_positions, dtype=torch.int64).float().unsqueeze(1) * inv
    cos, sin = freqs.cos(), freqs.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return torch.cat((cos, sin), dim=-1).to(device)
