"""round_robin: cycle through the ready engines in order, ignoring load."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from conduit_gateway.routing.selection.base import EngineSelector, Node, RouteRequest, SelectionOptions


class RoundRobinSelector(EngineSelector):
    """Cycles through the candidates; stateless apart from one counter."""

    name = "round_robin"

    def __init__(self, options: SelectionOptions | None = None) -> None:
        super().__init__(options)
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Node], request: RouteRequest | None = None) -> Node:
        return candidates[next(self._counter) % len(candidates)]
