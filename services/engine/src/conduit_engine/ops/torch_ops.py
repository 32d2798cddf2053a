"""Torch ops backend: runs on the CPU and is the numerical reference for every other backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from conduit_engine.ops.base import (
    AttentionMetadata,
    Ops,
    StepContext,
    check_gather_out,
    check_kv_block_args,
)
from conduit_engine.ops.kv_quant import dequantize, is_quantized, quantize


class TorchOps(Ops):
    """Every layer of a step sees the same positions and metadata, so the tensors derived from them
    (rotary cos/sin, gather indices, masks) are built once per step, in the step's scratch, by the
    first layer that needs them."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, step: StepContext) -> None:
        rope = step.scratch.get("rope")
        if rope is None:
            cos, sin = step.cos_sin_cache.index_select(0, step.positions).chunk(2, dim=-1)
            rope = step.scratch["rope"] = (
                torch.cat((cos, cos), dim=-1).unsqueeze(1),
                torch.cat((sin, sin), dim=-1).unsqueeze(1),
            )
        cos, sin = rope  # type: ignore[misc]
        for t in (q, k):
            t32 = t.float()
            half = t32.shape[-1] // 2
            rotated = torch.cat((-t32[..., half:], t32[..., :half]), dim=-1)
            t.copy_(t32 * cos + rotated * sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
        for x, cache in ((k, k_cache), (v, v_cache)):
            if is_quantized(cache):  # codes and scales, copied as bytes
                x, cache = quantize(x, cache.dtype).view(torch.uint8), cache.view(torch.uint8)
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        meta = step.meta
        if meta.is_decode_only:
            return self._decode_attention(q, k_cache, v_cache, step, scale, sliding_window, logit_softcap)
        out = torch.empty_like(q)
        # Layers with different windows read different spans of the context: one gather per window.
        key = f"context_spans:{sliding_window}"
        spans = step.scratch.get(key)
        if spans is None:
            spans = step.scratch[key] = [
                _context_span(meta.block_tables[i], seq_len - q_len, seq_len, meta.block_size, sliding_window)
                for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True))
            ]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            first_key, slots = spans[i]  # type: ignore[index]
            k = _read_slots(k_cache, slots, q.dtype).transpose(0, 1)
            v = _read_slots(v_cache, slots, q.dtype).transpose(0, 1)
            qi = q[start : start + q_len].transpose(0, 1)
            mask = _chunk_mask(q_len, seq_len - q_len - first_key, k.shape[1], sliding_window, q.device)
            out[start : start + q_len] = _attend(qi, k, v, scale, mask, logit_softcap).transpose(0, 1)
            start += q_len
        return out

    def _decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> torch.Tensor:
        # One query per sequence: gather every context (its window) into a padded [B, L, Hk, D] batch.
        meta = step.meta
        key = f"decode_gather:{sliding_window}"
        gather = step.scratch.get(key)
        if gather is None:
            gather = step.scratch[key] = _decode_gather(meta, q.device, sliding_window)
        slots, mask = gather  # type: ignore[misc]
        num_seqs, length = mask.shape
        k = _read_slots(k_cache, slots, q.dtype).view(num_seqs, length, k_cache.shape[2], -1)
        v = _read_slots(v_cache, slots, q.dtype).view(num_seqs, length, v_cache.shape[2], -1)
        out = _attend(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), scale, mask[:, None, None, :], logit_softcap
        )
        return out.squeeze(2)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        # Unpack every word into its 32 bits at once: [R, W] -> [R, W, 32] -> [R, W * 32], cut to V.
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
        selected = logits.index_select(0, rows)
        selected.masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, rows, selected)

    def gather_kv_blocks(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape = check_kv_block_args(kv_caches, block_ids)
        dtype = kv_caches[0][0].dtype
        if out is not None:
            check_gather_out(out, shape, dtype)
        same_device = out is not None and out.device == block_ids.device
        buffer = out if same_device else torch.empty(shape, dtype=dtype, device=block_ids.device)
        assert buffer is not None
        for layer, pair in enumerate(kv_caches):
            for kv, cache in enumerate(pair):
                torch.index_select(_as_bytes(cache), 0, block_ids, out=_as_bytes(buffer[layer, kv]))
        if out is not None and not same_device:
            out.copy_(buffer)
            return out
        return buffer

    def scatter_kv_blocks(
        self,
        buffer: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
    ) -> None:
        check_kv_block_args(kv_caches, block_ids, buffer)
        for layer, pair in enumerate(kv_caches):
            for kv, cache in enumerate(pair):
                _as_bytes(cache).index_copy_(0, block_ids, _as_bytes(buffer[layer, kv]))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A quantized cache (or transfer buffer) as its bytes: torch's index ops take no float8."""
    return t.view(torch.uint8) if is_quantized(t) else t


def _read_slots(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows [n, Hk, D] of cache slots `slots` [n], in `dtype` (dequantized from a quantized cache)."""
    if not is_quantized(cache):
        return cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    raw = cache.view(torch.uint8)
    rows = raw.view(-1, *raw.shape[2:]).index_select(0, slots).view(cache.dtype)
    return dequantize(rows, dtype)


def _decode_gather(
    meta: AttentionMetadata, device: torch.device, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of each sequence's visible context (its last `window` positions, or all), [B * L]
    padded to the longest, and the [B, L] mask of the real ones. Padding reads a visible slot."""
    bs = meta.block_size
    seq_lens = meta.seq_lens.to(device).long()
    length = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
    visible = seq_lens if window is None else seq_lens.clamp(max=window)
    first = (seq_lens - visible).unsqueeze(1)  # [B, 1]
    offsets = torch.arange(length, device=device).unsqueeze(0)
    mask = offsets < visible.unsqueeze(1)  # [B, L]
    positions = first + torch.where(mask, offsets, 0)
    blocks = meta.block_tables.to(device).long().gather(1, positions // bs)
    return (blocks * bs + positions % bs).reshape(-1), mask


def _context_span(
    block_table: torch.Tensor, first_query: int, seq_len: int, block_size: int, window: int | None
) -> tuple[int, torch.Tensor]:
    """(first key position, cache slots of keys first..seq_len-1): what a chunk whose first query is at
    `first_query` can see."""
    first = 0 if window is None else max(0, first_query - window + 1)
    positions = torch.arange(first, seq_len, device=block_table.device)
    blocks = block_table.long().index_select(0, positions // block_size)
    return first, blocks * block_size + positions % block_size


def _chunk_mask(
    q_len: int, offset: int, k_len: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """[q_len, k_len] visibility of a chunk whose query i sits at key index offset + i; None when it is
    the plain square causal mask (SDPA's fast path)."""
    if window is None and offset == 0 and q_len == k_len:
        return None
    rows = torch.arange(q_len, device=device).unsqueeze(1) + offset
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [..., Hq, Lq, D] over k, v [..., Hk, Lk, D]; mask (True = visible) broadcasts to the scores,
    None means square causal. Soft-capped scores are computed as transformers' eager attention does."""
    num_heads, num_kv_heads = q.shape[-3], k.shape[-3]
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
