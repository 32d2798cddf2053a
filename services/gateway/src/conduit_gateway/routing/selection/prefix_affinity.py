"""prefix_affinity: consistent hashing of the prompt's start, with bounded loads.

Requests whose prompts start the same way hash to the same engine, so its prefix cache already holds
their shared blocks. Each engine owns many points on a hash ring; a request walks the ring clockwise from
its key's hash and takes the first engine whose in-flight count stays within `affinity_load_factor` ×
the average (consistent hashing with bounded loads, `within_load_bound`): a hot prefix spills over to the next
engine on the ring, the same one every time, instead of overloading one. Adding or removing an engine only
moves the keys next to its points.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from conduit_gateway.routing.selection.base import (
    EngineSelector,
    Node,
    RouteRequest,
    SelectionOptions,
    within_load_bound,
)

POINTS_PER_NODE = 64
# Rings are cached per candidate set; sets change only when engines come, go or change health.
_MAX_CACHED_RINGS = 16


def ring_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """POINTS_PER_NODE points per address on a 64-bit ring; `walk` lists addresses clockwise from a hash."""

    def __init__(self, addresses: Sequence[str]) -> None:
        points = sorted(
            (ring_hash(f"{address}#{i}".encode()), address)
            for address in addresses
            for i in range(POINTS_PER_NODE)
        )
        self._hashes = [point for point, _ in points]
        self._owners = [owner for _, owner in points]
        self._count = len(set(addresses))

    def walk(self, key_hash: int) -> list[str]:
        """Every address once, in ring order starting at the first point at or after `key_hash`."""
        start = bisect.bisect_left(self._hashes, key_hash)
        seen: list[str] = []
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == self._count:
                    break
        return seen


class PrefixAffinitySelector(EngineSelector):
    name = "prefix_affinity"

    def __init__(self, options: SelectionOptions | None = None) -> None:
        super().__init__(options)
        self._rings: dict[frozenset[str], HashRing] = {}

    def choose(self, candidates: Sequence[Node], request: RouteRequest | None = None) -> Node:
        if len(candidates) == 1:
            return candidates[0]
        by_address = {node.address: node for node in candidates}
        key = request.prefix_key if request is not None else b""
        order = self._ring(by_address).walk(ring_hash(key))
        allowed = {node.address for node in within_load_bound(candidates, self.options.affinity_load_factor)}
        for address in order:
            if address in allowed:
                return by_address[address]
        return min((by_address[address] for address in order), key=lambda node: node.in_flight)

    def _ring(self, by_address: dict[str, Node]) -> HashRing:
        members = frozenset(by_address)
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) >= _MAX_CACHED_RINGS:
                self._rings.clear()
            ring = self._rings[members] = HashRing(sorted(members))
        return ring
