"""Torch ops backend: runs on the CPU and is the numerical reference for every other backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from conduit_engine.ops.base import AttentionMetadata, Ops, StepContext, check_kv_transfer


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
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
    ) -> torch.Tensor:
        meta = step.meta
        if meta.is_decode_only:
            return self._decode_attention(q, k_cache, v_cache, step, scale)
        out = torch.empty_like(q)
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        all_slots = step.scratch.get("context_slots")
        if all_slots is None:
            all_slots = step.scratch["context_slots"] = [
                _context_slots(meta.block_tables[i], seq_len, meta.block_size)
                for i, seq_len in enumerate(meta.seq_lens_cpu)
            ]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            slots = all_slots[i]  # type: ignore[index]
            k = k_flat.index_select(0, slots)
            v = v_flat.index_select(0, slots)
            qi = q[start : start + q_len]
            out[start : start + q_len] = _sdpa(qi, k, v, scale, causal_offset=seq_len - q_len)
            start += q_len
        return out

    def _decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
    ) -> torch.Tensor:
        # One query per sequence: gather every context into a padded [B, L, Hk, D] batch and mask.
        meta = step.meta
        num_seqs, max_len = meta.num_seqs, meta.max_seq_len
        gather = step.scratch.get("decode_gather")
        if gather is None:
            gather = step.scratch["decode_gather"] = _decode_gather(meta, q.device)
        slots, mask = gather  # type: ignore[misc]
        k = (
            k_cache.view(-1, *k_cache.shape[2:])
            .index_select(0, slots)
            .view(num_seqs, max_len, *k_cache.shape[2:])
        )
        v = (
            v_cache.view(-1, *v_cache.shape[2:])
            .index_select(0, slots)
            .view(num_seqs, max_len, *v_cache.shape[2:])
        )
        num_heads, num_kv_heads = q.shape[1], k.shape[2]
        qb = q.unsqueeze(2)  # [B, Hq, 1, D]
        kb = k.transpose(1, 2)  # [B, Hk, L, D]
        vb = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qb,
            kb,
            vb,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
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
        self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: torch.Tensor
    ) -> torch.Tensor:
        shape = check_kv_transfer(kv_caches, block_ids)
        buffer = torch.empty(shape, dtype=kv_caches[0][0].dtype, device=block_ids.device)
        for layer, pair in enumerate(kv_caches):
            for kv, cache in enumerate(pair):
                torch.index_select(cache, 0, block_ids, out=buffer[layer, kv])
        return buffer

    def scatter_kv_blocks(
        self,
        buffer: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_ids: torch.Tensor,
    ) -> None:
        check_kv_transfer(kv_caches, block_ids, buffer)
        for layer, pair in enumerate(kv_caches):
            for kv, cache in enumerate(pair):
                cache.index_copy_(0, block_ids, buffer[layer, kv])


def _decode_gather(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of every context position, [B * L] padded to the longest context, and the [B, L]
    mask of the real ones."""
    num_seqs, max_len, bs = meta.num_seqs, meta.max_seq_len, meta.block_size
    max_blocks = (max_len + bs - 1) // bs
    blocks = meta.block_tables[:, :max_blocks].long()
    offsets = torch.arange(bs, device=device)
    slots = (blocks.unsqueeze(-1) * bs + offsets).reshape(num_seqs, -1)[:, :max_len]
    positions = torch.arange(max_len, device=device)
    mask = positions.unsqueeze(0) < meta.seq_lens.to(device).unsqueeze(1)  # [B, L]
    return slots.reshape(-1), mask


def _context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    offsets = torch.arange(block_size, device=block_table.device)
    return (blocks.unsqueeze(-1) * block_size + offsets).reshape(-1)[:seq_len]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int
) -> torch.Tensor:
    """q [Lq, Hq, D] against k, v [Lk, Hk, D]; query i sees keys 0..causal_offset + i."""
    q_len, k_len = q.shape[0], k.shape[0]
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if causal_offset == 0 and q_len == k_len:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    else:
        rows = torch.arange(q_len, device=q.device).unsqueeze(1) + causal_offset
        mask = torch.arange(k_len, device=q.device).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    return out.transpose(0, 1)
