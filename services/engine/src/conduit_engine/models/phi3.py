"""Phi-3: the shared decoder. Its checkpoints already store the fused qkv_proj and gate_up_proj this
engine uses, its long-context variants use `longrope` scaling (layers/rotary.py), and a sliding window,
when set, covers every layer (models/architectures.py)."""

from __future__ import annotations

from conduit_engine.models.base import CausalLM


class Phi3ForCausalLM(CausalLM):
    """The shared decoder as it is."""
