"""qwen3: Qwen3 style `<think>…</think>`; the model writes the start tag itself, so an output that does
not begin with it (thinking disabled) is all content."""

from __future__ import annotations

from conduit_gateway.parsers.reasoning.base import ThinkTagParser


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"
    opened_by_template = False
