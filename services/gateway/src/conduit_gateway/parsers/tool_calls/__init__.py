"""Tool-call parsers: each module here may define a `ToolCallParser` subclass with a `name`, which makes
it a `--tool-call-parser` value; adding a format is adding one file."""

from __future__ import annotations

import importlib
import pkgutil

from conduit_gateway.parsers.tool_calls.base import (
    ParsedText,
    ToolCallDelta,
    ToolCallParser,
    registered_tool_call_parsers,
)

__all__ = [
    "ParsedText",
    "ToolCallDelta",
    "ToolCallParser",
    "tool_call_parser_class",
    "tool_call_parser_names",
]


def _import_parser_modules() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def tool_call_parser_names() -> tuple[str, ...]:
    """Every `--tool-call-parser` value, sorted."""
    _import_parser_modules()
    return tuple(sorted(registered_tool_call_parsers()))


def tool_call_parser_class(name: str) -> type[ToolCallParser]:
    """The parser registered as `name`; ValueError naming `tool_call_parser` when unknown."""
    _import_parser_modules()
    parser = registered_tool_call_parsers().get(name)
    if parser is None:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}")
    return parser
