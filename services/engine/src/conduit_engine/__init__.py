"""Conduit engine: serves one Hugging Face Llama-family model over gRPC with continuous batching."""

__version__ = "0.1.0"
