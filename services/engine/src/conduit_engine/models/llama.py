"""Llama 1/2/3, Mistral and Qwen2: the shared decoder as it is, with sliding windows and qkv biases."""

from __future__ import annotations

from typing import Any

from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import layer_windows


class LlamaForCausalLM(CausalLM):
    """attention_bias puts a bias on q, k, v and o (config_flags: none beyond the shared fields)."""


class MistralForCausalLM(CausalLM):
    @classmethod
    def config_flags(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        num_layers = int(cfg["num_hidden_layers"])
        return {"layer_windows": layer_windows(cfg, [True] * num_layers)}


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def config_flags(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False, "layer_windows": qwen_windows(cfg)}


def qwen_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: a window only with use_sliding_window, on the layers from max_window_layers on."""
    num_layers = int(cfg["num_hidden_layers"])
    if not cfg.get("use_sliding_window", False):
        return (None,) * num_layers
    first = int(cfg.get("max_window_layers", num_layers))
    return layer_windows(cfg, [i >= first for i in range(num_layers)])
