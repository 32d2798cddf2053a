"""Build a model from a Hugging Face folder: config.json + model.safetensors (or sharded with an index).

Weights are memory-mapped: `safe_open` maps each file and `get_tensor` returns a view of the mapping, so
a tensor already in the target dtype and device becomes the parameter without a copy, and every other
one is converted straight from the mapping (each byte of a checkpoint is read once). A tensor-parallel
rank (`shard`) reads only its own slices of each tensor (`get_slice`, parallel/sharding.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub.utils import tqdm
from safetensors import safe_open

from conduit_engine.errors import ModelLoadError
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.quantization import QuantizationPlan
from conduit_engine.models.registry import model_class
from conduit_engine.models.sharding import ModelShard, ShardPlan, read_shard
from conduit_engine.ops import Ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Checkpoint projections that we store fused: (fused name, part names in order). Checkpoints that
# already store the fused names (Phi-3) load as they are.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards named in the index are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def iter_checkpoint(files: list[Path], plan: ShardPlan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, as views of the memory-mapped files (or, with `plan`, the rank's
    slices of them), with a progress bar."""
    sizes = [f.stat().st_size for f in files]
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="Loading weights") as bar:
        for path, size in zip(files, sizes, strict=True):
            done = 0
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if plan is None:
                        tensor = f.get_tensor(name)
                    else:
                        tensor = read_shard(plan, name.removeprefix("model."), f.get_slice(name))
                    yield name, tensor
                    bar.update(tensor.nbytes)
                    done += tensor.nbytes
            bar.update(size - done)  # the file's header (and the other ranks' slices)


def load_model(
    folder: Path,
    config: ArchConfig,
    ops: Ops,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    shard: ModelShard | None = None,
    quantization: QuantizationPlan | None = None,
) -> CausalLM:
    """The model (or with `shard` one rank's part of it) on `device` in `dtype`; with `quantization`,
    projections as int8 (models/quantization.py)."""
    quant = quantization or QuantizationPlan()
    files = safetensors_files(folder)
    with torch.device("meta"):
        model = model_class(config.architecture)(config, ops, max_positions, shard)
    # Every parameter is built on the meta device and replaced by its checkpoint tensor (a view of the
    # mapped file when dtype and device match): no weight is allocated, initialised or copied twice.
    model.init_rope(torch.device(device))
    slots = _parameter_slots(model)
    if config.tie_word_embeddings:
        del slots["lm_head.weight"]
    pending: dict[str, list[torch.Tensor | None]] = {}
    loaded: set[str] = set()
    int8 = _Int8Weights()
    for raw_name, tensor in iter_checkpoint(files, None if shard is None else shard.plan):
        name = raw_name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if int8.take(name, tensor):
            continue
        fused = _fused_target(name)
        if fused is not None:
            target, index, count = fused
            parts = pending.setdefault(target, [None] * count)
            parts[index] = tensor
            if all(p is not None for p in parts):
                _place(slots, target, torch.cat(parts, dim=0), dtype, device)  # type: ignore[arg-type]
                loaded.add(target)
                del pending[target]
            continue
        _place(slots, name, tensor, dtype, device)
        loaded.add(name)
    loaded |= int8.place(slots, device)
    missing = sorted(set(slots) - loaded)
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks weights: {', '.join(missing[:5])}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if quant.quantize_float:
        _quantize_linears(model, quant.quantize_lm_head)
    model.finish_loading()
    model.eval()
    return model


def _fused_target(name: str) -> tuple[str, int, int] | None:
    """layers.3.self_attn.k_proj.weight → (layers.3.self_attn.qkv_proj.weight, 1, 3)."""
    for fused, parts in _FUSED.items():
        for index, part in enumerate(parts):
            marker = f".{part}."
            if marker in name:
                return name.replace(marker, f".{fused}."), index, len(parts)
    return None


def _parameter_slots(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """Parameter name → (its module, its attribute name, the meta parameter standing in for it)."""
    slots = {}
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            slots[f"{module_name}.{leaf}" if module_name else leaf] = (module, leaf, param)
    return slots


def _place(
    slots: dict[str, tuple[torch.nn.Module, str, torch.nn.Parameter]],
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    device: str,
) -> None:
    slot = slots.get(name)
    if slot is None:
        raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
    module, leaf, meta = slot
    if tuple(meta.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(meta.shape)}")
    # A no-op (the mapped view itself) when dtype and device already match.
    value = tensor.to(device=device, dtype=dtype).contiguous()
    module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


class _Int8Weights:
    """A quantized checkpoint's int8 projection weights and their scales, gathered while the files are
    read (a scale may come before or after its weight, in another file) and placed once all are in.
    q/k/v and gate/up parts fuse as the float ones do; a per-tensor scale becomes one per row first."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}  # checkpoint name (without .weight) → int8 [N, K]
        self.scales: dict[str, torch.Tensor] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        if name.endswith(".weight_scale"):
            self.scales[name.removesuffix(".weight_scale")] = tensor
            return True
        if name.endswith(".weight") and tensor.dtype == torch.int8:
            self.weights[name.removesuffix(".weight")] = tensor
            return True
        return False

    def place(
        self, slots: dict[str, tuple[torch.nn.Module, str, torch.nn.Parameter]], device: str
    ) -> set[str]:
        missing = sorted(set(self.weights) - set(self.scales))
        if missing:
            raise ModelLoadError(f"int8 weight {missing[0]}.weight has no {missing[0]}.weight_scale")
        stray = sorted(set(self.scales) - set(self.weights))
        if stray:
            raise ModelLoadError(f"{stray[0]}.weight_scale belongs to no int8 weight")
        fused: dict[str, list[tuple[int, str] | None]] = {}
        targets: dict[str, list[str]] = {}
        for prefix in self.weights:
            target = _fused_target(prefix + ".weight")
            if target is None:
                targets[prefix + ".weight"] = [prefix]
            else:
                parts = fused.setdefault(target[0], [None] * target[2])
                parts[target[1]] = (target[1], prefix)
        for target, parts in fused.items():
            if any(p is None for p in parts):
                raise ModelLoadError(f"{target}: the checkpoint has only some of its int8 parts")
            targets[target] = [p[1] for p in parts if p is not None]
        placed = set()
        for target, prefixes in targets.items():
            slot = slots.get(target)
            if slot is None or not hasattr(slot[0], "quantize"):
                raise ModelLoadError(f"int8 weight {target!r} is not a projection Conduit can run in int8")
            module, _, meta = slot
            weight = torch.cat([self.weights[p] for p in prefixes]).to(device)
            if tuple(weight.shape) != tuple(meta.shape):
                raise ModelLoadError(
                    f"weight {target!r} has shape {tuple(weight.shape)}, expected {tuple(meta.shape)}"
                )
            scale = torch.cat([_row_scales(p, self.scales[p], self.weights[p].shape[0]) for p in prefixes])
            module.quantize(weight, scale.to(device))  # type: ignore[operator]
            placed.add(target)
        return placed


def _row_scales(prefix: str, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight_scale, per tensor ([] or [1]) or per channel ([N, 1] or [N]), as [N] float32."""
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        return flat.expand(rows).clone()
    if flat.numel() != rows or (scale.dim() == 2 and scale.shape[1] != 1):
        raise ModelLoadError(
            f"{prefix}.weight_scale has shape {tuple(scale.shape)}: expected per-tensor [1] or per-channel "
            f"[{rows}, 1] (group-wise scales are not supported)"
        )
    return flat


def _quantize_linears(model: CausalLM, lm_head: bool) -> None:
    """--quantization int8: every float projection to int8 with per-output-channel scales (the LM head
    only with --quantize-lm-head; the embedding never)."""
    from conduit_engine.layers.linear import Linear

    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.quantized or (name == "lm_head" and not lm_head):
            continue
        q, scale = model.ops.quantize_weight(module.weight)
        module.quantize(q, scale)
