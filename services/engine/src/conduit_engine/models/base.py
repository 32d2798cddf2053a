"""The causal LM every architecture shares: embeddings, decoder layers, final norm, LM head, RoPE table.

An architecture is a subclass that says how its config.json maps onto the shared layers' flags
(`config_flags`); the forward pass is the same for all of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conduit_engine.layers.decoder import DecoderLayer, KVCache
from conduit_engine.layers.linear import Linear
from conduit_engine.layers.norm import RMSNorm
from conduit_engine.layers.rotary import cos_sin_cache
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import AttentionMetadata, DecoderRunner, Ops


class CausalLM(nn.Module):
    def __init__(self, config: ArchConfig, ops: Ops, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, config.norm_weight_offset)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, ops)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # [max_positions, head_dim] cos|sin table; filled on the target device by the loader.
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self._embed_scale: float | None = None
        # The decoder layers as one call, when the ops backend offers it (set once loading finishes).
        self._decoder: DecoderRunner | None = None

    @classmethod
    def config_flags(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """ArchConfig fields this architecture sets from config.json (none: plain Llama)."""
        return {}

    def init_rope(self, device: torch.device) -> None:
        self.cos_sin = cos_sin_cache(self.config, self.max_positions, device)

    def finish_loading(self) -> None:
        """Once the checkpoint's weights are in: fold norm offsets, round the embedding scale to the
        weights' dtype (as transformers multiplies by it in that dtype), let the ops backend prepare the
        linear weights and, where it can, compile the decoder layers into one call."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fold_offset()
            elif isinstance(module, Linear):
                self.ops.prepare_linear(module.weight)
        scale = self.config.embed_scale
        if scale is not None:
            self._embed_scale = float(torch.tensor(scale, dtype=self.embed_tokens.weight.dtype))
        self._decoder = self.ops.compile_decoder([layer.spec() for layer in self.layers])

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
        if self._embed_scale is not None:
            x = x * self._embed_scale
        if self._decoder is not None:
            x, residual = self._decoder(x, kv_caches, step)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, kv_cache, step)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] → logits [S, V] in float32."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
