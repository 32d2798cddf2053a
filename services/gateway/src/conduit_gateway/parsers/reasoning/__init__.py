"""Reasoning parsers: each module here may define a `ReasoningParser` subclass with a `name`, which makes
it a `--reasoning-parser` value; adding a format is adding one file."""

from __future__ import annotations

import importlib
import pkgutil

from conduit_gateway.parsers.reasoning.base import (
    ReasoningParser,
    ReasoningSplit,
    registered_reasoning_parsers,
)

__all__ = [
    "ReasoningParser",
    "ReasoningSplit",
    "reasoning_parser_class",
    "reasoning_parser_names",
]


def _import_parser_modules() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def reasoning_parser_names() -> tuple[str, ...]:
    """Every `--reasoning-parser` value, sorted."""
    _import_parser_modules()
    return tuple(sorted(registered_reasoning_parsers()))


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser registered as `name`; ValueError naming `reasoning_parser` when unknown."""
    _import_parser_modules()
    parser = registered_reasoning_parsers().get(name)
    if parser is None:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}")
    return parser
