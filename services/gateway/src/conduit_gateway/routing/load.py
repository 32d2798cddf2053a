"""What an engine reports about its occupancy (GetLoad), and the loop that polls it for one node."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from conduit.engine.v1 import engine_pb2

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
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters it serves

    @classmethod
    def from_pb(cls, reply: engine_pb2.GetLoadResponse) -> LoadReport:
        return cls(
            running=reply.running_requests,
            waiting=reply.waiting_requests,
            kv_blocks_used=reply.kv_blocks_used,
            kv_blocks_total=reply.kv_blocks_total,
            kv_blocks_cached=reply.kv_blocks_cached,
            prefix_cache_hit_rate=round(reply.prefix_cache_hit_rate, 6),
            lora_adapters=tuple(reply.lora_adapters),
        )


async def poll_load(
    address: str,
    serving: Callable[[], bool],
    get_load: Callable[[float], Awaitable[engine_pb2.GetLoadResponse]],
    report: Callable[[LoadReport | None], None],
    interval_s: float,
    timeout_s: float,
) -> None:
    """Every `interval_s` while `serving()`: `report` what `get_load(timeout_s)` (one GetLoad) answered;
    `report(None)` when it failed or the engine does not serve. `address` names the engine in the log.

    A stale report is worse than none: strategies fall back to the gateway's own in-flight count.
    """
    while True:
        if serving():
            try:
                report(LoadReport.from_pb(await get_load(timeout_s)))
            except grpc.aio.AioRpcError as exc:
                log.debug("engine %s GetLoad failed: %s", address, exc.code().name)
                report(None)
        else:
            report(None)
        await asyncio.sleep(interval_s)
