"""What an engine reports about its occupancy (GetLoad), and the loop that polls it for one node."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from conduit.engine.v1 import engine_pb2

if TYPE_CHECKING:
    from conduit_gateway.routing.node import EngineNode

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One GetLoad answer (the admin API shows it as it is)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float

    @classmethod
    def from_pb(cls, reply: engine_pb2.GetLoadResponse) -> LoadReport:
        return cls(
            running=reply.running_requests,
            waiting=reply.waiting_requests,
            kv_blocks_used=reply.kv_blocks_used,
            kv_blocks_total=reply.kv_blocks_total,
            kv_blocks_cached=reply.kv_blocks_cached,
            prefix_cache_hit_rate=round(reply.prefix_cache_hit_rate, 6),
        )


async def poll_load(node: EngineNode, interval_s: float, timeout_s: float) -> None:
    """Refresh `node.load` every `interval_s` (each GetLoad within `timeout_s`) while the node serves;
    forget it when it does not.

    A stale report is worse than none: strategies fall back to the gateway's own in-flight count.
    """
    while True:
        if node.serving:
            try:
                node.load = LoadReport.from_pb(await node.client.load(timeout_s))
            except grpc.aio.AioRpcError as exc:
                log.debug("engine %s GetLoad failed: %s", node.address, exc.code().name)
                node.load = None
        else:
            node.load = None
        await asyncio.sleep(interval_s)
