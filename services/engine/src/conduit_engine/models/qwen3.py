"""Qwen3: the shared decoder with an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from typing import Any

from conduit_engine.models.base import CausalLM
from conduit_engine.models.llama import qwen_windows


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def config_flags(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        return {"qk_norm": True, "layer_windows": qwen_windows(cfg)}
