"""Reasoning parsers: each module here may define a `ReasoningParser` subclass with a `name`, which makes
it a `--reasoning-parser` value; adding a format is adding one file."""

from __future__ import annotations

from conduit_gateway.parsers.reasoning.base import REGISTRY, ReasoningParser, ReasoningSplit

__all__ = ["ReasoningParser", "ReasoningSplit", "reasoning_parser_class", "reasoning_parser_names"]

reasoning_parser_names = REGISTRY.names
reasoning_parser_class = REGISTRY.get
