"""The set of engines behind the gateway: background health polling and picking an engine for a model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection

from conduit_gateway.config import GatewayConfig
from conduit_gateway.engine.client import EngineClient
from conduit_gateway.engine.selection import EngineSelector, make_selector
from conduit_gateway.errors import model_not_found, no_engine_ready

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 1.0


class EnginePool:
    """Engines with their last known health; `acquire` returns a SERVING engine that serves the model."""

    def __init__(self, config: GatewayConfig, selector: EngineSelector | None = None) -> None:
        self._config = config
        # Channels are made in start(): a grpc.aio channel belongs to the event loop it was created on.
        self.engines: list[EngineClient] = []
        self._selector = selector or make_selector(config.routing)
        self._poller: asyncio.Task[None] | None = None
        self._refreshing: asyncio.Future[bool] | None = None

    async def start(self) -> None:
        self.engines = [EngineClient(address, self._config) for address in self._config.engines]
        await self.refresh()
        self._poller = asyncio.create_task(self._poll(), name="engine-health-poller")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()
        await asyncio.gather(*(engine.close() for engine in self.engines))

    async def refresh(self) -> bool:
        """Check every engine now; True when at least one is SERVING.

        Concurrent callers (probes, the poller, requests during an outage) share one round of checks
        instead of each sending its own.
        """
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._check_all())
        # shield: one caller giving up (e.g. its client went away) must not cancel the others' round.
        return await asyncio.shield(self._refreshing)

    async def _check_all(self) -> bool:
        results = await asyncio.gather(*(engine.check(HEALTH_TIMEOUT_S) for engine in self.engines))
        return any(results)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            try:
                await self.refresh()
            except Exception:  # the poller must outlive any single bad check
                log.exception("engine health check failed")

    def serving(self) -> list[EngineClient]:
        return [engine for engine in self.engines if engine.serving]

    def served_models(self) -> dict[str, EngineClient]:
        """Model name → one serving engine that serves it (the first, for its model info)."""
        models: dict[str, EngineClient] = {}
        for engine in self.serving():
            if engine.model is not None:
                models.setdefault(engine.model, engine)
        return models

    def mark_unavailable(self, engine: EngineClient) -> None:
        """An RPC said UNAVAILABLE: stop routing there until the next health check says SERVING."""
        engine.serving = False

    async def acquire(self, model: str, exclude: Collection[EngineClient] = ()) -> EngineClient:
        """Pick a SERVING engine for `model`, skipping `exclude`.

        Raises 503 when no engine is ready and 404 when the ready engines serve other models.
        """
        if not self.serving():
            # The poller may simply not have seen a just-started engine yet.
            await self.refresh()
        ready = [engine for engine in self.serving() if engine not in exclude]
        if not ready:
            raise no_engine_ready()
        candidates = [engine for engine in ready if engine.model == model]
        if not candidates:
            if any(engine.model == model for engine in self.engines):
                raise no_engine_ready(f"no engine serving `{model}` is ready")
            raise model_not_found(model)
        return self._selector.choose(candidates)


def require_serving(pool: EnginePool) -> None:
    """Raise 503 unless some engine is SERVING (for endpoints that only read cached engine state)."""
    if not pool.serving():
        raise no_engine_ready()
