"""One gateway's Responses state: its store (None when storing is off) and its background runs.

A background response runs as a task of the replica that accepted it; a cancel request reaches that
task through the store (the memory store calls back at once, Redis publishes to the owning replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from conduit_common.secret_files import read_secret_file
from conduit_gateway.config import GatewayConfig
from conduit_gateway.responses.store import (
    MemoryResponseStore,
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
)

log = logging.getLogger(__name__)


def store_from_config(config: GatewayConfig) -> ResponseStore | None:
    """The store --response-store names: memory (default), none, or a redis:// / rediss:// URL."""
    target = config.response_store
    if target == "none":
        return None
    if target == "memory":
        return MemoryResponseStore(config.response_store_ttl_s, config.response_store_max_bytes)
    from conduit_gateway.responses.redis_store import RedisResponseStore

    password = None
    if config.response_store_password_file is not None:
        password = (
            read_secret_file("response_store_password_file", config.response_store_password_file)
            .decode()
            .strip()
        )
    return RedisResponseStore(target, config.response_store_ttl_s, password=password)


class ResponsesService:
    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store
        self._runs: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        if self.store is not None:
            await self.store.start(self.cancel_local)

    async def stop(self) -> None:
        runs = list(self._runs.values())
        for task in runs:
            task.cancel()
        for task in runs:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.store is not None:
            await self.store.close()

    def run(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run a background response here until it ends or is cancelled."""
        task = asyncio.create_task(work, name=f"response {response_id}")
        self._runs[response_id] = task
        task.add_done_callback(lambda _: self._runs.pop(response_id, None))

    def cancel_local(self, response_id: str) -> None:
        task = self._runs.get(response_id)
        if task is not None:
            task.cancel()

    @property
    def _store(self) -> ResponseStore:
        if self.store is None:
            raise StoreUnavailable("this gateway runs without a response store")
        return self.store

    async def get(self, response_id: str, key: str | None = None) -> StoredResponse | None:
        """The record, if it exists and was made with the API key named `key`."""
        record = await self._store.get(response_id)
        return record if record is not None and record.key == key else None

    async def put(self, record: StoredResponse) -> None:
        await self._store.put(record)

    async def delete(self, response_id: str) -> bool:
        return await self._store.delete(response_id)

    async def append_events(
        self, response_id: str, events: list[dict[str, Any]], record: StoredResponse | None = None
    ) -> None:
        await self._store.append_events(response_id, events, record)

    def follow(self, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        return self._store.follow(response_id, after)

    async def request_cancel(self, record: StoredResponse) -> bool:
        return await self._store.request_cancel(record)
