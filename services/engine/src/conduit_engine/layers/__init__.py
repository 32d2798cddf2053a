"""Shared building blocks of the Llama family; model files compose them with flags."""
