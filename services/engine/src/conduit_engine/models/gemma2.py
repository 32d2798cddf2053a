"""Gemma 2: the shared decoder with GeGLU (tanh GELU), embeddings scaled by sqrt(hidden_size), norms
computing (1 + weight), a norm after attention and around the MLP, a sliding window on every other
layer (the first one included), attention scores scaled by query_pre_attn_scalar and soft-capped, and
soft-capped final logits. Embeddings are tied. Every one of these is an ArchConfig field
(models/architectures.py) the shared decoder reads."""

from __future__ import annotations

from conduit_engine.models.base import CausalLM


class Gemma2ForCausalLM(CausalLM):
    """The shared decoder, configured by its ArchConfig."""
