"""Llama 1/2/3, Mistral and Qwen2: the shared decoder as it is, with sliding windows and qkv biases
(their ArchConfig fields: models/architectures.py)."""

from __future__ import annotations

from conduit_engine.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    """attention_bias puts a bias on q, k, v and o."""


class MistralForCausalLM(CausalLM):
    """A sliding window, when set, on every layer."""


class Qwen2ForCausalLM(CausalLM):
    """Biases on q, k and v (not o); a window from max_window_layers on, with use_sliding_window."""
