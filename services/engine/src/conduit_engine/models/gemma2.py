"""Gemma 2: the shared decoder with GeGLU (tanh GELU), embeddings scaled by sqrt(hidden_size), norms
computing (1 + weight), a norm after attention and around the MLP, a sliding window on every other
layer (the first one included), attention scores scaled by query_pre_attn_scalar and soft-capped, and
soft-capped final logits. Embeddings are tied."""

from __future__ import annotations

from typing import Any

from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import activation, layer_windows


class Gemma2ForCausalLM(CausalLM):
    @classmethod
    def config_flags(cls, cfg: dict[str, Any]) -> dict[str, Any]:
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
