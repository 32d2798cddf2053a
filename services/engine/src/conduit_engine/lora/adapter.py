"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) read and checked.

Supported: LoRA (`peft_type` LORA) on the attention and MLP projections (`q_proj`, `k_proj`, `v_proj`,
`o_proj`, `gate_proj`, `up_proj`, `down_proj`, and Phi-3's fused `qkv_proj` and `gate_up_proj`), any rank,
`lora_alpha` with the standard (alpha / r) or rsLoRA (alpha / sqrt(r)) scaling, `bias` "none". Everything
else is refused with a message saying what: DoRA (`use_dora`), `modules_to_save`, LoRA on the embeddings
or the LM head, other modules, per-module ranks or alphas, trained biases, a rank above --max-lora-rank.

The scaling is folded into B once, at load: the delta of a row x is (x Aᵀ) (scale B)ᵀ.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from conduit_engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from conduit_engine.models.sharding import ShardPlan

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)

# PEFT's module name → (this engine's linear layer, the slice of its output the module covers; None: all).
TARGETS: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.qkv_proj": ("self_attn.qkv_proj", None),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
_EMBEDDINGS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(InvalidRequestError):
    """An adapter cannot be loaded: missing files, an unsupported option, another base model."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__("lora_path", f"adapter {name!r}: {message}")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter, on the CPU. `weights[(layer, peft module)]` = (A [r, in], scale·B [out, r])."""

    name: str
    path: str
    rank: int
    scaling: float
    base_model: str | None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def read_config(name: str, folder: Path, max_rank: int) -> dict[str, Any]:
    """adapter_config.json, checked against what this engine supports."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(name, f"{folder} has no {CONFIG_FILE} (a PEFT LoRA adapter folder is expected)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(name, f"cannot read {path}: {exc}") from exc
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type {peft_type} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise AdapterError(name, "DoRA (use_dora: true) is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            name, f"modules_to_save ({', '.join(map(str, cfg['modules_to_save']))}) is not supported"
        )
    if cfg.get("bias", "none") != "none":
        raise AdapterError(name, f"bias {cfg['bias']!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(name, f"{key} (per-module ranks or alphas) is not supported")
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    embedding = [t for t in names if any(e in t for e in _EMBEDDINGS)]
    if embedding:
        raise AdapterError(name, f"embedding LoRA ({', '.join(embedding)}) is not supported")
    rank = int(cfg.get("r", 8))
    if rank < 1:
        raise AdapterError(name, f"r must be >= 1, got {rank}")
    if rank > max_rank:
        raise AdapterError(name, f"rank {rank} exceeds --max-lora-rank {max_rank}")
    return cfg


def load_adapter(name: str, folder: Path, max_rank: int) -> LoraAdapter:
    """The adapter in `folder` (a local folder; Hub ids are resolved by `lora.source`), on the CPU."""
    from safetensors import safe_open

    cfg = read_config(name, folder, max_rank)
    rank = int(cfg.get("r", 8))
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(name, f"{folder} has no {WEIGHTS_FILE}")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            if "lora_embedding" in key or any(f".{e}." in key for e in _EMBEDDINGS):
                raise AdapterError(name, f"embedding LoRA ({key}) is not supported")
            if "lora_magnitude_vector" in key:
                raise AdapterError(name, "DoRA (lora_magnitude_vector) is not supported")
            match = _KEY.search(key)
            if match is None:
                raise AdapterError(name, f"weight {key} is not a LoRA matrix of a supported module")
            layer, block, module, which = match.groups()
            target = f"{block}.{module}"
            if target not in TARGETS:
                supported = ", ".join(sorted(m.split(".")[1] for m in TARGETS))
                raise AdapterError(name, f"LoRA on {module} is not supported (supported: {supported})")
            parts.setdefault((int(layer), target), {})[which] = f.get_tensor(key).float()
    if not parts:
        raise AdapterError(name, f"{weights_path} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(name, f"layer {layer} {target}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise AdapterError(
                name,
                f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a "
                f"LoRA pair of rank <= {max_rank}",
            )
        weights[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
    base = cfg.get("base_model_name_or_path")
    return LoraAdapter(name, str(folder), rank, scaling, None if base is None else str(base), weights)


# PEFT modules whose base layer is row-parallel under tensor parallelism (the others are column-parallel).
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def shard_adapter(adapter: LoraAdapter, plan: ShardPlan) -> LoraAdapter:
    """One tensor-parallel rank's part of `adapter`, sharded as its base layers are (models/sharding.py):
    a column-parallel layer's B keeps this rank's output rows (A whole); a row-parallel layer's A keeps
    this rank's input columns (B whole), so each rank's partial delta joins the base layer's all-reduce."""
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        pieces = plan.pieces(f"layers.{layer}.{module}.weight")
        if pieces is not None:
            dim, ranges = pieces
            if module in ROW_PARALLEL:
                a = torch.cat([a[:, lo:hi] for lo, hi in ranges], dim=1).contiguous()
            else:
                b = torch.cat([b[lo:hi] for lo, hi in ranges], dim=0).contiguous()
        weights[(layer, module)] = (a, b)
    return dataclasses.replace(adapter, weights=weights)
