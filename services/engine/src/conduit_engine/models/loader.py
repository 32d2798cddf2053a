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
) -> CausalLM:
    """The model (or with `shard` one rank's part of it) on `device` in `dtype`."""
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
    for raw_name, tensor in iter_checkpoint(files, None if shard is None else shard.plan):
        name = raw_name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
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
    missing = sorted(set(slots) - loaded)
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks weights: {', '.join(missing[:5])}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
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
