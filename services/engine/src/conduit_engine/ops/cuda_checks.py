"""Argument checks of the CUDA ops: shapes, strides and dtypes the kernels in kernels/ rely on.

A kernel reads raw pointers, so a wrong layout corrupts memory instead of raising. Each check raises
ValueError naming the argument. `CudaOps` runs the step-level checks once per step (`check_step`), the
cache checks once when the cache is allocated, and the per-call checks only when it is built with
`check_calls=True` (its default, for direct use and tests; the engine turns them off because its model
code fixes every activation's layout once the weights and caches have passed).
"""

from __future__ import annotations

import torch

from conduit_engine.kv_format import SCALE_BYTES
from conduit_engine.ops.base import AttentionMetadata
from conduit_engine.ops.kv_quant import is_quantized


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    check(tensor.dtype == dtype, f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def pack_elems(dtype: torch.dtype) -> int:
    """Elements of `dtype` in one 16-byte vector (conduit::Pack<T>)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def check_norm_weight(weight: torch.Tensor, hidden: int, dtype: torch.dtype) -> None:
    check(
        weight.dim() == 1 and weight.shape[0] == hidden,
        f"weight: expected shape ({hidden},), got {tuple(weight.shape)}",
    )
    check(weight.is_contiguous(), "weight: must be contiguous")
    check_dtype("weight", weight, dtype)


def check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    check(
        x.shape == residual.shape, f"residual: shape {tuple(residual.shape)} differs from x {tuple(x.shape)}"
    )
    check_dtype("residual", residual, x.dtype)


def check_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
    check(q.dim() == 3 and k.dim() == 3, f"q, k: expected [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    num_tokens, _, head_dim = q.shape
    check(
        k.shape[0] == num_tokens and k.shape[2] == head_dim,
        f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens and head_dim",
    )
    check(head_dim % 2 == 0, f"q: head_dim must be even, got {head_dim}")
    check_dtype("k", k, q.dtype)
    for name, t in (("q", q), ("k", k)):
        # Rotated in place, so the layout cannot be fixed by a copy.
        check(
            t.stride(2) == 1 and t.stride(1) == head_dim,
            f"{name}: heads must be contiguous (strides [*, {head_dim}, 1]), got {t.stride()}",
        )
    check(
        positions.shape == (num_tokens,),
        f"positions: expected contiguous int64 [{num_tokens}], "
        f"got {positions.dtype} {tuple(positions.shape)}",
    )


def check_positions(positions: torch.Tensor) -> None:
    check(
        positions.dim() == 1 and positions.dtype == torch.int64 and positions.is_contiguous(),
        f"positions: expected contiguous int64 [T], got {positions.dtype} {tuple(positions.shape)}",
    )


def check_cos_sin(cos_sin_cache: torch.Tensor, head_dim: int | None = None) -> None:
    width = cos_sin_cache.shape[1] if cos_sin_cache.dim() == 2 else -1
    check(
        cos_sin_cache.dim() == 2 and (head_dim is None or width == head_dim),
        f"cos_sin_cache: expected [max_positions, {head_dim or 'head_dim'}], "
        f"got {tuple(cos_sin_cache.shape)}",
    )
    check_dtype("cos_sin_cache", cos_sin_cache, torch.float32)
    check(cos_sin_cache.is_contiguous(), "cos_sin_cache: must be contiguous")


def cache_head_dim(k_cache: torch.Tensor) -> int:
    """head_dim of a cache: its last dimension, less the scale bytes of a quantized one (kv_quant.py)."""
    return k_cache.shape[3] - (SCALE_BYTES if is_quantized(k_cache) else 0)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check(
        k_cache.dim() == 4,
        f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}",
    )
    check(v_cache.shape == k_cache.shape, f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache")
    check_dtype("v_cache", v_cache, k_cache.dtype)
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache, v_cache: must be contiguous")
    block_size, head_dim = k_cache.shape[1], cache_head_dim(k_cache)
    check(
        block_size > 0 and block_size & (block_size - 1) == 0,
        f"k_cache: block_size must be a power of two, got {block_size}",
    )
    if is_quantized(k_cache):  # read byte by byte; the query's dtype bounds head_dim (check_attention)
        check(head_dim > 0 and head_dim % 2 == 0, f"k_cache: head_dim must be even, got {head_dim}")
        return
    vec = pack_elems(k_cache.dtype)
    check(head_dim % vec == 0, f"k_cache: head_dim must be a multiple of {vec} for {k_cache.dtype}")


def check_kv_rows(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], cache_head_dim(k_cache)
    num_tokens = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        check(
            t.dim() == 3 and t.shape == (num_tokens, num_kv_heads, head_dim),
            f"{name}: expected [{num_tokens}, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}",
        )
        check_dtype(name, t, k.dtype if is_quantized(k_cache) else k_cache.dtype)
        check(
            t.stride(2) == 1 and t.stride(1) == head_dim,
            f"{name}: heads must be contiguous (strides [*, {head_dim}, 1]), got {t.stride()}",
        )
    check(
        slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64,
        f"slot_mapping: expected int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}",
    )
    check(slot_mapping.is_contiguous(), "slot_mapping: must be contiguous")


def check_meta(meta: AttentionMetadata) -> None:
    num_seqs = meta.num_seqs
    check(
        meta.seq_lens.shape == (num_seqs,) and meta.seq_lens.dtype == torch.int32,
        f"meta.seq_lens: expected int32 [{num_seqs}], got {meta.seq_lens.dtype} {tuple(meta.seq_lens.shape)}",
    )
    check(
        meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == num_seqs,
        f"meta.block_tables: expected [{num_seqs}, max_blocks], got {tuple(meta.block_tables.shape)}",
    )
    check_dtype("meta.block_tables", meta.block_tables, torch.int32)
    check(meta.block_tables.stride(1) == 1, "meta.block_tables: rows must be contiguous")
    check(meta.seq_lens.is_contiguous(), "meta.seq_lens: must be contiguous")
    if not meta.is_decode_only:
        check(
            meta.query_start_loc.shape == (num_seqs + 1,) and meta.query_start_loc.dtype == torch.int32,
            f"meta.query_start_loc: expected int32 [{num_seqs + 1}], got "
            f"{meta.query_start_loc.dtype} {tuple(meta.query_start_loc.shape)}",
        )


def check_attention(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    _, block_size, num_kv_heads, _ = k_cache.shape
    head_dim = cache_head_dim(k_cache)
    check(q.dim() == 3 and q.shape[2] == head_dim, f"q: expected [T, Hq, {head_dim}], got {tuple(q.shape)}")
    if is_quantized(k_cache):
        vec = pack_elems(q.dtype)
        check(head_dim % vec == 0, f"q: head_dim must be a multiple of {vec} for {q.dtype}, got {head_dim}")
    else:
        check_dtype("q", q, k_cache.dtype)
    check(
        q.stride(2) == 1 and q.stride(1) == head_dim, f"q: heads must be contiguous, got strides {q.stride()}"
    )
    check(
        q.shape[1] % num_kv_heads == 0,
        f"q: {q.shape[1]} heads is not a multiple of the cache's {num_kv_heads} KV heads",
    )
    check(
        meta.block_size == block_size, f"meta.block_size: {meta.block_size} != cache block size {block_size}"
    )
    check(
        sum(meta.query_lens_cpu) == q.shape[0],
        f"q: {q.shape[0]} tokens but meta.query_lens_cpu sums to {sum(meta.query_lens_cpu)}",
    )
    if not meta.is_decode_only:
        check(head_dim % 8 == 0, f"q: head_dim must be a multiple of 8 for prefill attention, got {head_dim}")


def check_window(sliding_window: int | None, logit_softcap: float | None) -> None:
    check(
        sliding_window is None or sliding_window >= 1,
        f"sliding_window: must be None or >= 1, got {sliding_window}",
    )
    check(
        logit_softcap is None or logit_softcap > 0, f"logit_softcap: must be None or > 0, got {logit_softcap}"
    )


def check_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    check(logits.dim() == 2, f"logits: expected [B, V], got {tuple(logits.shape)}")
    check_dtype("logits", logits, torch.float32)
    check(logits.stride(1) == 1, "logits: rows must be contiguous")
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    check(vocab <= 2**30, f"logits: vocabulary of {vocab} exceeds 2^30")
    check(
        bitmask.dim() == 2 and bitmask.shape[1] == words,
        f"bitmask: expected [R, {words}] for a vocabulary of {vocab}, got {tuple(bitmask.shape)}",
    )
    check_dtype("bitmask", bitmask, torch.int32)
    check(bitmask.is_contiguous(), "bitmask: must be contiguous")
    num_rows = bitmask.shape[0]
    check(rows.shape == (num_rows,), f"rows: expected shape ({num_rows},), got {tuple(rows.shape)}")
    check_dtype("rows", rows, torch.int64)
    check(rows.is_contiguous(), "rows: must be contiguous")
    check(num_rows <= 65535, f"bitmask: at most 65535 rows per launch (grid.y), got {num_rows}")
