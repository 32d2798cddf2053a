"""Conduit gateway: the OpenAI HTTP API in front of the engine's gRPC stream (no torch)."""

from __future__ import annotations

__version__ = "0.1.0"
