"""kv_aware: the engine that already caches most of the prompt, weighed against how busy it is.

Each candidate e gets a score (NVIDIA Dynamo's KV router cost, negated so that higher is better):

    score(e) = kv_overlap_weight × cached(e) − active(e)

- cached(e): leading blocks of the prompt the KV index says e holds, i.e. the prompt's chained block
  hashes (computed from its token ids exactly as the engine computes them) up to the first one e lacks,
  at most (prompt tokens − 1) // block_size (the engine always leaves one token to compute). 0 for an
  engine whose event snapshot is not in: such an engine is routed by load alone.
- active(e): KV blocks e's live sequences hold: the prompt blocks of this gateway's requests open on e
  (exact and immediate), or e's last GetLoad kv_blocks_used when that is larger and newer than this
  gateway's last request start or end on e (a stale poll would make e look busy right after a request).

Choosing e saves kv_overlap_weight × cached(e) blocks of prefill and adds to a queue of active(e) blocks.
Only engines within the load bound compete (`affinity_load_factor` × the mean in-flight count, as
prefix_affinity bounds its ring): the cost alone lets a long cached conversation pull its turns onto an
engine whose queue then makes them wait longer than their prefill would have taken elsewhere. With
`router_temperature` 0 the best score wins (ties: fewer in-flight requests, then rotation); above 0 an
engine is drawn with probability ∝ exp(s(e) / T), s being the scores scaled to [−1, 0] by their range, so
equal engines share the traffic and a hot prefix does not pin one engine.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

from conduit_common.kv_blocks import prefix_block_hashes
from conduit_gateway.routing.selection.base import (
    EngineSelector,
    Node,
    RouteRequest,
    SelectionOptions,
    within_load_bound,
)


class KvAwareSelector(EngineSelector):
    name = "kv_aware"

    def __init__(self, options: SelectionOptions | None = None) -> None:
        super().__init__(options)
        self._random = random.Random(self.options.seed)
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Node], request: RouteRequest | None = None) -> Node:
        if len(candidates) > 1:
            candidates = within_load_bound(candidates, self.options.affinity_load_factor) or candidates
        scores = [self._score(node, request) for node in candidates]
        if len(candidates) == 1:
            return candidates[0]
        temperature = self.options.router_temperature
        if temperature > 0:
            best, worst = max(scores), min(scores)
            spread = max(best - worst, 1e-9)
            weights = [math.exp((score - best) / spread / temperature) for score in scores]
            return self._random.choices(list(candidates), weights)[0]
        start = next(self._counter) % len(candidates)
        order = [*range(start, len(candidates)), *range(start)]
        best_index = max(order, key=lambda i: (scores[i], -candidates[i].in_flight))
        return candidates[best_index]

    def _score(self, node: Node, request: RouteRequest | None) -> float:
        tokens = request.token_ids if request is not None else None
        block_size = node.block_size
        if not tokens or not block_size:
            return -float(node.kv_active_blocks)
        cached = self._cached_blocks(node, tokens, block_size)
        assert request is not None
        request.predicted_blocks[node.address] = cached
        return self.options.kv_overlap_weight * cached - node.kv_active_blocks

    def _cached_blocks(self, node: Node, tokens: tuple[int, ...], block_size: int) -> int:
        index = self.options.kv_index
        if index is None:
            return 0
        # The engine reuses at most (n − 1) // block_size blocks: hash only those.
        return index.overlap(node.address, prefix_block_hashes(tokens[:-1], block_size))
