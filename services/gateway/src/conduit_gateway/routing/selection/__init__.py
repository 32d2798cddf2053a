"""Routing strategies: how one engine is picked among the ready candidates for a request.

Every module in this package may define strategies: a subclass of `EngineSelector` with a `name` is
registered by defining it, so adding a strategy is adding one file here (`--routing NAME` then selects it).
"""

from __future__ import annotations

import importlib
import pkgutil

from conduit_gateway.routing.selection.base import (
    EngineSelector,
    RoutableNode,
    RouteRequest,
    SelectionOptions,
    registered_strategies,
)
from conduit_gateway.routing.selection.round_robin import RoundRobinSelector

__all__ = [
    "EngineSelector",
    "RoundRobinSelector",
    "RoutableNode",
    "RouteRequest",
    "SelectionOptions",
    "make_selector",
    "strategy_names",
]


def _import_strategy_modules() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def strategy_names() -> tuple[str, ...]:
    """Every `--routing` value, sorted."""
    _import_strategy_modules()
    return tuple(sorted(registered_strategies()))


def make_selector(strategy: str, options: SelectionOptions | None = None) -> EngineSelector:
    """A new selector for a `--routing` value; ValueError naming `routing` when it is unknown."""
    _import_strategy_modules()
    selector_class = registered_strategies().get(strategy)
    if selector_class is None:
        raise ValueError(f"routing: unknown strategy {strategy!r}")
    return selector_class(options or SelectionOptions())
