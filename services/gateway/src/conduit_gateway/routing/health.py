"""Following one engine's grpc.health.v1 status with a Watch stream that is re-opened with backoff.

The engine pushes every status change, so a node leaves the rotation as soon as its engine says
NOT_SERVING (drain) or its connection breaks (crash), and comes back as soon as it says SERVING again.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2

from conduit_gateway.race import finished_first

log = logging.getLogger(__name__)


class Backoff:
    """Exponential delays from `initial_s` up to `maximum_s`, with jitter so replicas do not reconnect in
    lockstep; `reset()` after a success."""

    def __init__(self, initial_s: float, maximum_s: float) -> None:
        self.initial_s = min(initial_s, maximum_s)
        self.maximum_s = maximum_s
        self._next = self.initial_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.maximum_s)
        return delay * random.uniform(0.8, 1.0)

    def reset(self) -> None:
        self._next = self.initial_s


class HealthWatch:
    """Runs one engine's Watch loop: `watch()` opens a grpc.health.v1 Watch stream, and every status it
    learns goes to `set_health(serving)`; `rewatch()` re-opens the stream to learn the current status now.
    A stream that fails (a broken connection, not an ending or a rewatch) is also told to `on_broken`.
    `address` names the engine in the log."""

    def __init__(
        self,
        address: str,
        watch: Callable[[], grpc.aio.UnaryStreamCall],
        set_health: Callable[[bool], Awaitable[None]],
        initial_backoff_s: float,
        max_backoff_s: float,
        on_broken: Callable[[str], None] | None = None,
    ) -> None:
        self._address = address
        self._on_broken = on_broken
        self._watch = watch
        self._set_health = set_health
        self._backoff = Backoff(initial_backoff_s, max_backoff_s)
        self._rewatch = asyncio.Event()

    def rewatch(self) -> None:
        """Ask for a fresh Watch: a Watch only speaks on change, so after a request saw UNAVAILABLE and
        ejected the node, only a new stream tells whether the engine still serves."""
        self._rewatch.set()

    async def run(self) -> None:
        while True:
            call = self._watch()
            try:
                await self._follow(call)
            except grpc.aio.AioRpcError as exc:
                log.info("engine %s health watch ended: %s", self._address, exc.code().name)
                if self._on_broken is not None:
                    self._on_broken(f"health watch broke: {exc.code().name}")
            finally:
                call.cancel()
            # Ended stream, broken connection or a rewatch: out of rotation until a stream says SERVING.
            await self._set_health(False)
            await asyncio.sleep(self._backoff.next())

    async def _follow(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._rewatch.clear()
        while True:
            read = asyncio.ensure_future(call.read())
            try:
                await finished_first(read, self._rewatch.wait())
            finally:
                if not read.done():
                    call.cancel()
                    await asyncio.gather(read, return_exceptions=True)
            if read.cancelled():
                return
            response = read.result()
            if response is grpc.aio.EOF:
                return
            self._backoff.reset()
            await self._set_health(response.status == health_pb2.HealthCheckResponse.SERVING)
