"""Self-attention over the paged KV cache: fused qkv projection, optional per-head q/k RMSNorm, RoPE,
cache write, attention (sliding window and logit soft-capping per layer), o_proj (row-parallel when the
model is sharded: parallel/sharding.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conduit_engine.layers.linear import Linear, RowParallelLinear
from conduit_engine.layers.norm import RMSNorm
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import Ops, StepContext

if TYPE_CHECKING:
    from conduit_engine.layers.collectives import Communicator


class PagedAttention(nn.Module):
    """`config` holds this rank's heads (all of them when the model runs whole); with a communicator
    o_proj sums the ranks' partial outputs."""

    def __init__(
        self, config: ArchConfig, ops: Ops, layer_index: int, comm: Communicator | None = None
    ) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.sliding_window = config.layer_windows[layer_index]
        self.logit_softcap = config.attn_logit_softcap
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.qkv_bias, ops)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, config.o_bias, ops, comm)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.qk_norm = config.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        step: StepContext,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x, step).split(self.split, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        k_cache, v_cache = kv_cache
        self.ops.rotary_and_write_kv(q, k, v, k_cache, v_cache, step)
        out = self.ops.attention(
            q,
            k_cache,
            v_cache,
            step,
            self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )
        return self.o_proj(out.reshape(num_tokens, -1), step)
