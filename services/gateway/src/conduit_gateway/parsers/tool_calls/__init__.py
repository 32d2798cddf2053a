"""Tool-call parsers: each module here may define a `ToolCallParser` subclass with a `name`, which makes
it a `--tool-call-parser` value; adding a format is adding one file."""

from __future__ import annotations

from conduit_gateway.parsers.tool_calls.base import REGISTRY, ParsedText, ToolCallDelta, ToolCallParser

__all__ = [
    "ParsedText",
    "ToolCallDelta",
    "ToolCallParser",
    "tool_call_parser_class",
    "tool_call_parser_names",
]

tool_call_parser_names = REGISTRY.names
tool_call_parser_class = REGISTRY.get
