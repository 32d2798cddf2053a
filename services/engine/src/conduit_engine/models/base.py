"""The causal LM every architecture shares: embeddings, decoder layers, final norm, LM head, RoPE table.

An architecture is a subclass; how its config.json maps onto the shared layers' flags is a torch-free
table (models/architectures.py), and the forward pass is the same for all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from conduit_engine.layers.decoder import DecoderLayer, KVCache
from conduit_engine.layers.linear import Linear
from conduit_engine.layers.norm import RMSNorm
from conduit_engine.layers.rotary import cos_sin_cache
from conduit_engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import AttentionMetadata, DecoderRunner, LoraBatch, Ops

if TYPE_CHECKING:
    from conduit_engine.models.sharding import ModelShard


class CausalLM(nn.Module):
    """The whole model, or with `shard` one tensor-parallel rank's part of it (parallel/sharding.py):
    `config` is always the full model's; `local_config` has this rank's head and MLP sizes."""

    def __init__(
        self, config: ArchConfig, ops: Ops, max_positions: int, shard: ModelShard | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        comm = None if shard is None else shard.comm
        self.local_config = config if shard is None else shard.plan.local_config(config)
        vocab_rows = config.vocab_size if shard is None else shard.plan.vocab_shard
        vocab_start = 0 if shard is None else shard.plan.vocab_start
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, hidden, vocab_start, comm)
        self.layers = nn.ModuleList(
            DecoderLayer(self.local_config, ops, i, comm) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps, ops, config.norm_weight_offset)
        self.lm_head = ParallelLMHead(vocab_rows, hidden, config.vocab_size, ops, comm)
        self._sharded = comm is not None
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # [max_positions, head_dim] cos|sin table; filled on the target device by the loader.
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self._embed_scale: float | None = None
        # The decoder layers as one call, when the ops backend offers it (set once loading finishes).
        self._decoder: DecoderRunner | None = None
        self._decoder_lora = False  # whether it adds the LoRA deltas of a step's adapter rows

    def init_rope(self, device: torch.device) -> None:
        self.cos_sin = cos_sin_cache(self.config, self.max_positions, device)

    def finish_loading(self) -> None:
        """Once the checkpoint's weights are in: fold norm offsets, round the embedding scale to the
        weights' dtype (as transformers multiplies by it in that dtype), let the ops backend prepare the
        linear weights (this rank's shards, when sharded) and, where it can, compile the decoder layers
        into one call. A sharded model runs its layers one by one: a compiled stack has no point between
        layers to all-reduce at (each layer still runs on the backend's linear and attention kernels)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fold_offset()
            elif isinstance(module, Linear):
                self.ops.prepare_linear(module.weight, module.weight_scale)
        scale = self.config.embed_scale
        if scale is not None:
            self._embed_scale = float(torch.tensor(scale, dtype=self.embed_tokens.weight.dtype))
        self.compile_decoder()

    def compile_decoder(self) -> None:
        """(Re)build the one-call decoder, where the backend offers one; again once the LoRA pools exist
        (lora/pool.py), so that steps with adapter rows run it too."""
        if not self._sharded:
            specs = [layer.spec() for layer in self.layers]
            self._decoder = self.ops.compile_decoder(specs)
            self._decoder_lora = all(spec.qkv_lora is not None for spec in specs)

    def describe_ops(self) -> str:
        """The ops backend and how the decoder layers run on it (one call per step, or one by one)."""
        layers = "one call per step" if self._decoder is not None else "layer by layer"
        return f"{self.ops.describe()}, decoder {layers}"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 → final hidden states [T, H]. `lora`: the rows that run an
        adapter (a compiled decoder runs them when it was built with the adapter pools)."""
        step = self.ops.begin_step(positions, meta, self.cos_sin)
        step.lora = lora
        x = self.embed_tokens(input_ids)
        if self._embed_scale is not None:
            x = x * self._embed_scale
        if self._decoder is not None and (lora is None or self._decoder_lora):
            x, residual = self._decoder(x, kv_caches, step)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, kv_cache, step)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [S, H] → logits [S, V] in float32. Sharded, every rank must call it and only rank 0
        gets the logits (None on the others)."""
        logits = self.lm_head(hidden)
        if logits is None:
            return None
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
