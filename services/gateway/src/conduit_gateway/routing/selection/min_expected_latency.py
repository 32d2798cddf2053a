"""min_expected_latency: the engine where a new request should finish its tokens soonest.

The estimate is (requests at the engine + 1) × its recent seconds per generated token: with continuous
batching every request at an engine shares its steps, so both a longer queue and a slower engine (or a
bigger batch) stretch the next request's time per token. An engine with no observed latency yet gets the
mean of the others (or is compared on load alone when none has one), so new engines are not starved.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from conduit_gateway.routing.selection.base import EngineSelector, Node, RouteRequest, SelectionOptions


class MinExpectedLatencySelector(EngineSelector):
    name = "min_expected_latency"

    def __init__(self, options: SelectionOptions | None = None) -> None:
        super().__init__(options)
        # Rotates where ties are broken, so equal engines share the traffic instead of the first taking all.
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Node], request: RouteRequest | None = None) -> Node:
        known = [node.token_latency_s for node in candidates if node.token_latency_s is not None]
        fallback = sum(known) / len(known) if known else 1.0
        start = next(self._counter) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda node: expected_latency(node, fallback))


def expected_latency(node: Node, fallback_token_latency_s: float) -> float:
    """Seconds per token a new request can expect at `node` (a relative score, not a promise)."""
    latency = node.token_latency_s if node.token_latency_s is not None else fallback_token_latency_s
    return (node.load_score + 1) * latency
