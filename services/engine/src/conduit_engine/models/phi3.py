"""Phi-3: the shared decoder. Its checkpoints already store the fused qkv_proj and gate_up_proj this
engine uses, its long-context variants use `longrope` scaling (layers/rotary.py), and a sliding window,
when set, covers every layer."""

from __future__ import annotations

from typing import Any

from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import layer_windows


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def config_flags(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        num_layers = int(cfg["num_hidden_layers"])
        return {"layer_windows": layer_windows(cfg, [True] * num_layers)}
