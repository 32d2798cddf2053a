"""Qwen3: the shared decoder with an RMSNorm over each query and key head before RoPE (`qk_norm`,
set in models/architectures.py)."""

from __future__ import annotations

from conduit_engine.models.base import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """The shared decoder with qk_norm."""
