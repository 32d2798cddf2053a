"""The reference arithmetic of quantized KV caches (kv_format.py describes the formats).

A quantized cache of one layer is [num_blocks, block_size, num_kv_heads, head_dim + SCALE_BYTES] of
int8 or float8_e4m3fn: each (token, kv head) row holds head_dim codes, then the row's scale as a bfloat16
in its last two bytes (little endian). Writing a row x (computed in float32):

    scale = bfloat16(max|x| / QMAX)                     QMAX: 127 (int8), 448 (fp8 e4m3)
    code  = int8:  clamp(round_half_even(x / scale), -127, 127)
            fp8:   float8_e4m3fn(clamp(x / scale, -448, 448))   (round to nearest even)
    (a row of zeros has scale 0 and codes 0)

and reading it back gives code * scale. Every backend computes exactly this (the CPU and CUDA kernels
bit for bit), so tests compare their caches byte for byte with these functions.
"""

from __future__ import annotations

import torch

from conduit_engine.kv_format import QUANTIZED_ELEMENTS, SCALE_BYTES

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_ELEMENTS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def cache_layout(kv_cache_dtype: str, compute_dtype: torch.dtype, head_dim: int) -> tuple[torch.dtype, int]:
    """(element dtype, size of the last dimension) of a cache for `--kv-cache-dtype`."""
    if kv_cache_dtype == "auto":
        return compute_dtype, head_dim
    if kv_cache_dtype not in QUANTIZED_ELEMENTS:
        raise ValueError(f"--kv-cache-dtype: expected auto, int8 or fp8, got {kv_cache_dtype!r}")
    return _ELEMENTS[kv_cache_dtype], head_dim + SCALE_BYTES


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether `cache` holds codes and scales (else values of the compute dtype)."""
    return cache.dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] → rows [..., D + SCALE_BYTES] of `dtype` (int8 or float8_e4m3fn): codes, then scale."""
    x32 = x.float()
    qmax = QMAX[dtype]
    scale = (x32.abs().amax(-1, keepdim=True) / qmax).to(torch.bfloat16)
    s32 = scale.float()
    scaled = torch.where(s32 > 0, x32 / torch.where(s32 > 0, s32, 1.0), 0.0).clamp(-qmax, qmax)
    codes = scaled.round().to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    rows[..., : x.shape[-1]] = codes.view(torch.uint8)
    rows[..., x.shape[-1] :] = scale.contiguous().view(torch.uint8)
    return rows.view(dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [..., D + SCALE_BYTES] (int8 or float8_e4m3fn) → values [..., D] (code * scale) in `dtype`."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    raw = rows.view(torch.uint8)
    scale = raw[..., head_dim:].contiguous().view(torch.bfloat16).float()
    return (rows[..., :head_dim].float() * scale).to(dtype)
