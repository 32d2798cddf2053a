"""One decoder layer: attention then gated MLP, with pre-norms on a fused residual stream and, for
Gemma 2 (`sandwich_norms`), a norm after attention and norms before and after the MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conduit_engine.layers.attention import PagedAttention
from conduit_engine.layers.mlp import GatedMLP
from conduit_engine.layers.norm import RMSNorm
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import DecoderLayerSpec, Ops, StepContext

if TYPE_CHECKING:
    from conduit_engine.layers.collectives import Communicator

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ArchConfig, ops: Ops, layer_index: int, comm: Communicator | None = None
    ) -> None:
        super().__init__()
        size, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        self.input_layernorm = RMSNorm(size, eps, ops, offset)
        self.self_attn = PagedAttention(config, ops, layer_index, comm)
        self.post_attention_layernorm = RMSNorm(size, eps, ops, offset)
        self.mlp = GatedMLP(config, ops, comm)
        self.sandwich_norms = config.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, ops, offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, ops, offset)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        step: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream without it); the next norm adds them."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, kv_cache, step)
        if not self.sandwich_norms:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h, step), residual
        h = self.post_attention_layernorm.norm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm.norm(self.mlp(h, step)), residual

    def spec(self) -> DecoderLayerSpec:
        """This layer's weights and shape, for a backend that runs whole layers (Ops.compile_decoder)."""
        attn, mlp = self.self_attn, self.mlp
        sandwich = self.sandwich_norms
        return DecoderLayerSpec(
            input_norm=self.input_layernorm.weight,
            post_attention_norm=self.post_attention_layernorm.weight,
            pre_feedforward_norm=self.pre_feedforward_layernorm.weight if sandwich else None,
            post_feedforward_norm=self.post_feedforward_layernorm.weight if sandwich else None,
            qkv=attn.qkv_proj.weight,
            qkv_bias=attn.qkv_proj.bias,
            q_norm=attn.q_norm.weight if attn.qk_norm else None,
            k_norm=attn.k_norm.weight if attn.qk_norm else None,
            o=attn.o_proj.weight,
            o_bias=attn.o_proj.bias,
            gate_up=mlp.gate_up_proj.weight,
            gate_up_bias=mlp.gate_up_proj.bias,
            down=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            scale=attn.scale,
            eps=self.input_layernorm.eps,
            sliding_window=attn.sliding_window,
            logit_softcap=attn.logit_softcap,
            gelu=mlp.gelu,
            qkv_lora=attn.qkv_proj.lora,
            o_lora=attn.o_proj.lora,
            gate_up_lora=mlp.gate_up_proj.lora,
            down_lora=mlp.down_proj.lora,
        )
