"""The adapter weight pool: beside every projection LoRA may target, a fixed tensor of `max_loras` slots
of rank `max_lora_rank`, allocated once when the engine starts (before the KV cache is sized, so loading
an adapter never reallocates the cache). An adapter runs from a slot; writing one copies its matrices in
(zero-padded to the pool's rank, zero on the modules it does not target)."""

from __future__ import annotations

import torch

from conduit_engine.layers.linear import Linear
from conduit_engine.lora.adapter import TARGETS, AdapterError, LoraAdapter
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.ops import LoraWeights

# (layer index, fused module name) → (input features, widths of the output slices)
Shapes = dict[tuple[int, str], tuple[int, tuple[int, ...]]]


def full_shapes(arch: ArchConfig) -> Shapes:
    """The whole model's projection shapes (what an adapter must fit, whatever the sharding)."""
    d = arch.head_dim
    q, kv, hidden, inter = arch.num_heads * d, arch.num_kv_heads * d, arch.hidden_size, arch.intermediate_size
    shapes: Shapes = {}
    for i in range(arch.num_layers):
        shapes[(i, "self_attn.qkv_proj")] = (hidden, (q, kv, kv))
        shapes[(i, "self_attn.o_proj")] = (q, (hidden,))
        shapes[(i, "mlp.gate_up_proj")] = (hidden, (inter, inter))
        shapes[(i, "mlp.down_proj")] = (inter, (hidden,))
    return shapes


def check_adapter(adapter: LoraAdapter, shapes: Shapes) -> None:
    """Raise AdapterError unless every matrix of `adapter` fits the projections `shapes` describe."""
    num_layers = 1 + max(layer for layer, _ in shapes)
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        if layer >= num_layers:
            raise AdapterError(
                adapter.name,
                f"made for another base model: it has layer {layer}, this model {num_layers} layers",
            )
        fused, part = TARGETS[module]
        in_features, splits = shapes[(layer, fused)]
        width = sum(splits) if part is None else splits[part]
        if a.shape[1] != in_features or b.shape[0] != width:
            raise AdapterError(
                adapter.name,
                f"made for another base model: layer {layer} {module} maps {a.shape[1]} → {b.shape[0]} "
                f"features, this model's {in_features} → {width}",
            )


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
                max_loras, len(splits) * max_rank, linear.out_features, dtype=param.dtype, device=param.device
            )
            linear.lora = LoraWeights(a, b, splits)
        model.compile_decoder()  # a one-call decoder now adds the deltas too

    @property
    def nbytes(self) -> int:
        return sum(lin.lora.a.nbytes + lin.lora.b.nbytes for lin, _ in self.layers.values() if lin.lora)

    def check(self, adapter: LoraAdapter) -> None:
        """Raise AdapterError unless every matrix of `adapter` fits this model's (this rank's) layers."""
        check_adapter(adapter, {key: (lin.in_features, splits) for key, (lin, splits) in self.layers.items()})

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
                ranks = slice(j * self.max_rank, j * self.max_rank + rank)
                w.b[slot, ranks, rows].copy_((b if part is not None else b[rows]).t())
