"""The adapter weight pool: beside every projection LoRA may target, a fixed tensor of `max_loras` slots
of rank `max_lora_rank`, allocated once when the engine starts (before the KV cache is sized, so loading
an adapter never reallocates the cache). An adapter runs from a slot; writing one copies its matrices in
(zero-padded to the pool's rank, zero on the modules it does not target)."""

from __future__ import annotations

import torch

from conduit_engine.layers.linear import Linear
from conduit_engine.lora.adapter import TARGETS, AdapterError, LoraAdapter
from conduit_engine.models.base import CausalLM
from conduit_engine.ops import LoraWeights


def lora_layers(model: CausalLM) -> dict[tuple[int, str], tuple[Linear, tuple[int, ...]]]:
    """(layer index, fused module name) → (the linear layer, the widths of its output slices)."""
    found: dict[tuple[int, str], tuple[Linear, tuple[int, ...]]] = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        found[(i, "self_attn.qkv_proj")] = (attn.qkv_proj, tuple(attn.split))
        found[(i, "self_attn.o_proj")] = (attn.o_proj, (attn.o_proj.out_features,))
        half = mlp.gate_up_proj.out_features // 2
        found[(i, "mlp.gate_up_proj")] = (mlp.gate_up_proj, (half, half))
        found[(i, "mlp.down_proj")] = (mlp.down_proj, (mlp.down_proj.out_features,))
    return found


class LoraPool:
    def __init__(self, model: CausalLM, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers = lora_layers(model)
        self.num_layers = len(model.layers)
        param = model.embed_tokens.weight
        for linear, splits in self.layers.values():
            a = torch.zeros(
                max_loras, len(splits), max_rank, linear.in_features, dtype=param.dtype, device=param.device
            )
            b = torch.zeros(
                max_loras, linear.out_features, len(splits) * max_rank, dtype=param.dtype, device=param.device
            )
            linear.lora = LoraWeights(a, b, splits)
        model.compile_decoder()  # a one-call decoder now adds the deltas too

    @property
    def nbytes(self) -> int:
        return sum(lin.lora.a.nbytes + lin.lora.b.nbytes for lin, _ in self.layers.values() if lin.lora)

    def check(self, adapter: LoraAdapter) -> None:
        """Raise AdapterError unless every matrix of `adapter` fits this model's layers."""
        for (layer, module), (a, b) in sorted(adapter.weights.items()):
            if layer >= self.num_layers:
                raise AdapterError(
                    adapter.name,
                    f"made for another base model: it has layer {layer}, this model {self.num_layers} layers",
                )
            fused, part = TARGETS[module]
            linear, splits = self.layers[(layer, fused)]
            width = linear.out_features if part is None else splits[part]
            if a.shape[1] != linear.in_features or b.shape[0] != width:
                raise AdapterError(
                    adapter.name,
                    f"made for another base model: layer {layer} {module} maps {a.shape[1]} → {b.shape[0]} "
                    f"features, this model's {linear.in_features} → {width}",
                )

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` (checked) into `slot`, replacing whatever was there."""
        for linear, _ in self.layers.values():
            assert linear.lora is not None
            linear.lora.a[slot].zero_()
            linear.lora.b[slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            fused, part = TARGETS[module]
            linear, splits = self.layers[(layer, fused)]
            w = linear.lora
            assert w is not None
            rank = a.shape[0]
            starts = [sum(splits[:j]) for j in range(len(splits))]
            for j in range(len(splits)) if part is None else (part,):
                w.a[slot, j, :rank].copy_(a)
                rows = slice(starts[j], starts[j] + splits[j])
                cols = slice(j * self.max_rank, j * self.max_rank + rank)
                w.b[slot, rows, cols].copy_(b if part is not None else b[rows])
