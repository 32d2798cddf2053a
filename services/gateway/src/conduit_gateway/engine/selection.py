"""How one engine is picked among the ready candidates: a small interface the routing issue extends."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from conduit_gateway.engine.client import EngineClient


class EngineSelector(Protocol):
    """Picks the engine for one request among ready candidates (never empty)."""

    def choose(self, candidates: Sequence[EngineClient]) -> EngineClient: ...


class RoundRobinSelector:
    """Cycles through the candidates in order; stateless apart from one counter."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[EngineClient]) -> EngineClient:
        return candidates[next(self._counter) % len(candidates)]


def make_selector(strategy: str) -> EngineSelector:
    """The selector for a `--routing` value (validated by GatewayConfig)."""
    if strategy == "round_robin":
        return RoundRobinSelector()
    raise ValueError(f"routing: unknown strategy {strategy!r}")
