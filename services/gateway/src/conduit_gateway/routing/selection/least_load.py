"""least_load: the power of two random choices on each engine's load.

Two distinct candidates are drawn at random and the one with fewer requests at it wins. Looking at two
instead of all keeps a burst of requests (or several gateways acting on the same stale view) from all
piling onto the one engine that looked emptiest, while still steering clear of busy engines.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from conduit_gateway.routing.selection.base import EngineSelector, Node, RouteRequest, SelectionOptions


class LeastLoadSelector(EngineSelector):
    name = "least_load"

    def __init__(self, options: SelectionOptions | None = None) -> None:
        super().__init__(options)
        self._random = random.Random(self.options.seed)

    def choose(self, candidates: Sequence[Node], request: RouteRequest | None = None) -> Node:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._random.sample(list(candidates), 2)
        # Ties go to the node with fewer of this gateway's own requests (the fresher number).
        return min((first, second), key=lambda node: (node.load_score, node.in_flight))
