"""Llama-family decoder (Llama 1/2/3, Mistral, Qwen2): flags in ArchConfig select the differences."""

from __future__ import annotations

import torch
from torch import nn

from conduit_engine.layers.attention import PagedAttention
from conduit_engine.layers.mlp import GatedMLP
from conduit_engine.layers.norm import RMSNorm
from conduit_engine.layers.rotary import cos_sin_cache
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import AttentionMetadata, Ops, StepContext

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, ops: Ops) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = PagedAttention(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = GatedMLP(config, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        step: StepContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, kv_cache, step)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig, ops: Ops, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # [max_positions, head_dim] cos|sin table; filled on the target device by the loader.
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def init_rope(self, device: torch.device) -> None:
        self.cos_sin = cos_sin_cache(self.config, self.max_positions, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 → final hidden states [T, H]."""
        step = self.ops.begin_step(positions, meta, self.cos_sin)
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, kv_cache, step)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] → logits [S, V] in float32."""
        return self.lm_head(hidden).float()
