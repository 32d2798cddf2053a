"""Which Hugging Face architectures this engine serves, what each sets in its ArchConfig from config.json,
and the ArchConfig of a model folder. Torch-free: reading a model's config imports no `nn.Module`
(`models/registry.py` maps the names to their classes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conduit_engine.errors import ModelLoadError
from conduit_engine.models.config import ArchConfig, activation, layer_windows

Flags = Callable[[dict[str, Any]], dict[str, Any]]


def _no_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama: attention_bias puts a bias on q, k, v and o; nothing beyond the shared fields."""
    return {}


def _window_on_every_layer(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mistral, Phi-3: a sliding window, when set, covers every layer."""
    return {"layer_windows": layer_windows(cfg, [True] * int(cfg["num_hidden_layers"]))}


def _qwen_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: a window only with use_sliding_window, on the layers from max_window_layers on."""
    num_layers = int(cfg["num_hidden_layers"])
    if not cfg.get("use_sliding_window", False):
        return (None,) * num_layers
    first = int(cfg.get("max_window_layers", num_layers))
    return layer_windows(cfg, [i >= first for i in range(num_layers)])


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False, "layer_windows": _qwen_windows(cfg)}


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    """An RMSNorm over each query and key head before RoPE."""
    return {"qk_norm": True, "layer_windows": _qwen_windows(cfg)}


def _gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    """GeGLU (tanh GELU), embeddings scaled by sqrt(hidden_size), norms computing (1 + weight), a norm after
    attention and around the MLP, a window on every other layer (the first included), attention scores
    scaled by query_pre_attn_scalar and soft-capped, soft-capped final logits, tied embeddings."""
    num_layers = int(cfg["num_hidden_layers"])
    return {
        "hidden_act": activation(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        ),
        "layer_windows": layer_windows(cfg, [i % 2 == 0 for i in range(num_layers)]),
        "attention_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logit_softcap": _optional_float(cfg.get("attn_logit_softcapping")),
        "final_logit_softcap": _optional_float(cfg.get("final_logit_softcapping")),
        "embed_scale": float(cfg["hidden_size"]) ** 0.5,
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


# Architecture name (config.json "architectures") → the ArchConfig fields it sets.
ARCHITECTURES: dict[str, Flags] = {
    "LlamaForCausalLM": _no_flags,
    "MistralForCausalLM": _window_on_every_layer,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Phi3ForCausalLM": _window_on_every_layer,
    "Gemma2ForCausalLM": _gemma2,
}


def arch_config(cfg: dict[str, Any]) -> ArchConfig:
    """Parse config.json's content; an unknown architecture is a ModelLoadError listing the supported."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}: "
            f"supported are {', '.join(ARCHITECTURES)}"
        )
    try:
        flags = ARCHITECTURES[arch](cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc
    return ArchConfig.from_dict(cfg, arch, flags)


def read_arch_config(folder: Path) -> ArchConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        return arch_config(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}") from exc
