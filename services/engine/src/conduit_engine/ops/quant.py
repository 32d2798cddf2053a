"""Int8 weights and activations (W8A8), the reference every backend's int8 linear must match.

A quantized linear layer keeps its weight as int8 [N, K] with one float32 scale per output channel
(`weight_scale` [N]): w ≈ weight * weight_scale[:, None]. At run time every input row (token) is
quantized on its own: scale = max|x| / 127, q = round(x * (127 / max|x|)) (ties to even, |q| <= 127, a
zero row quantizes to zeros with scale 0), the products of q and the weight are summed exactly in int32,
and the sum is scaled back in float32:

    out[m, n] = float(acc[m, n]) * (x_scale[m] * weight_scale[n]) + bias[n]

in that order, so a kernel computing the same integers and the same three float32 roundings matches it
bit for bit (one that fuses the multiply and the add rounds once less: within a float rounding).
`|q| <= 127` (never -128) lets the AVX2 kernels multiply |x| by sign-adjusted weights without
saturating the int16 pairs of vpmaddubsw.

Group-wise scales (one per `group` consecutive inputs of a channel, and of a token) are here as a
reference only (`int8_linear_grouped`), to measure what they buy against per-channel scales.
"""

from __future__ import annotations

import torch

QMAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) → (int8 [M, K], float32 scales [M]): symmetric, one scale per row."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # a true float32 division (`QMAX / amax` is computed by torch as QMAX * (1 / amax): another rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] → (int8 [N, K], float32 per-output-channel scales [N])."""
    return quantize_rows(weight.detach())


def int_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [M, K] int8 @ w [N, K]ᵀ int8 → int32 [M, N], exactly."""
    # torch 2.13's CPU _int_mm returns garbage for K == 1: only shapes whose K is a multiple of 8
    if q.shape[1] % 8 == 0 and (q.device.type == "cpu" or q.shape[0] > 16):
        try:
            return torch._int_mm(q.contiguous(), w.t().contiguous())
        except RuntimeError:  # shapes this build's _int_mm refuses (CUDA: multiples of 8)
            pass
    # float64 holds every partial sum exactly (|acc| <= K * 127² < 2^53)
    return (q.double() @ w.double().t()).to(torch.int32)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float @ (int8 weight [N, K] with scales [N])ᵀ + bias → [M, N] in x.dtype (W8A8)."""
    q, x_scale = quantize_rows(x)
    acc = int_matmul(q, weight)
    out = acc.float() * (x_scale[:, None] * weight_scale.float().reshape(1, -1))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantize_grouped(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (int8 [M, K], float32 scales [M, K / group]); K must be a multiple of group."""
    m, k = x.shape
    q, s = quantize_rows(x.reshape(m * k // group, group))
    return q.reshape(m, k), s.reshape(m, k // group)


def int8_linear_grouped(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """The float weight [N, K] and x both quantized in groups of `group` inputs (llama.cpp's q8_0 with
    group 32): each group's int32 sum scaled by its two scales, the groups summed in float32."""
    m, k = x.shape
    n = weight.shape[0]
    if k % group:
        return int8_linear(x, *quantize_weight(weight))
    qx, sx = quantize_grouped(x, group)
    qw, sw = quantize_grouped(weight.float(), group)
    g = k // group
    acc = torch.einsum(
        "mgk,ngk->mng", qx.reshape(m, g, group).double(), qw.reshape(n, g, group).double()
    ).float()
    return (acc * (sx[:, None, :] * sw[None, :, :])).sum(-1).to(x.dtype)
