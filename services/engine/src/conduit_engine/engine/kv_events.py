"""Publishing the block manager's prefix-cache events to SubscribeKvEvents subscribers.

The engine loop thread calls `publish()` after every step and every batch of commands: it takes the
pending events as one numbered batch (core/kv_events.py) and hands it to each subscriber's event loop.
A subscriber starts with `subscribe()`, which registers it and takes the snapshot in one command on the
engine thread, so the snapshot and the batches that follow it neither overlap nor leave a gap. A
subscriber whose queue holds `max_pending` batches is dropped (its stream ends with RESOURCE_EXHAUSTED):
a slow reader never slows the step loop or grows the engine's memory without bound.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.kv_events import BlockStored, KvEventBatch, KvEventLog
from conduit_engine.errors import QueueFullError

MAX_PENDING_BATCHES = 4096


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """Every block cached when the subscription started, current as of batch `sequence`."""

    sequence: int
    blocks: list[BlockStored]


class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[KvEventBatch | None] = asyncio.Queue()
        self.max_pending = max_pending
        self.overflowed = False

    def offer(self, batch: KvEventBatch | None) -> None:
        """On the subscriber's loop: queue a batch (None ends the stream)."""
        if self.overflowed:
            return
        if batch is not None and self.queue.qsize() >= self.max_pending:
            self.overflowed = True
            batch = None
        self.queue.put_nowait(batch)


class KvEventPublisher:
    """Owns the block manager's event log and the live subscriptions."""

    def __init__(self, block_manager: BlockManager, max_pending: int = MAX_PENDING_BATCHES) -> None:
        self.log = KvEventLog()
        block_manager.events = self.log
        self.engine_id = uuid.uuid4().hex  # a restarted engine is a new id
        self.block_size = block_manager.block_size
        self._max_pending = max_pending
        self._subscribers: list[_Subscriber] = []
        self._lock = threading.Lock()

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def publish(self) -> None:
        """Engine thread: send the pending events, if any, as the next batch to every subscriber."""
        batch = self.log.take_batch()
        if batch is None:
            return
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            _call_soon(sub, batch)

    def clear(self) -> None:
        """Engine thread: every cached block is gone (the model cannot run any more)."""
        self.log.cleared()
        self.publish()

    def close(self) -> None:
        """End every subscription (the engine stops)."""
        with self._lock:
            subscribers, self._subscribers = self._subscribers, []
        for sub in subscribers:
            _call_soon(sub, None)

    async def subscribe(
        self, run_on_engine: Callable[[Callable[[], Any]], Awaitable[Any]]
    ) -> tuple[KvSnapshot, AsyncIterator[KvEventBatch]]:
        """The snapshot and the batches after it; leaving the iterator unsubscribes. The iterator raises
        QueueFullError when the subscriber fell `max_pending` batches behind."""
        sub = _Subscriber(asyncio.get_running_loop(), self._max_pending)

        def start() -> KvSnapshot:
            self.publish()  # events before the snapshot go to the older subscribers only
            with self._lock:
                self._subscribers.append(sub)
            return KvSnapshot(*self.log.snapshot())

        snapshot: KvSnapshot = await run_on_engine(start)
        return snapshot, self._batches(sub)

    async def _batches(self, sub: _Subscriber) -> AsyncIterator[KvEventBatch]:
        try:
            while (batch := await sub.queue.get()) is not None:
                yield batch
            if sub.overflowed:
                raise QueueFullError(
                    f"the KV event subscriber fell {sub.max_pending} batches behind; subscribe again"
                )
        finally:
            with self._lock:
                if sub in self._subscribers:
                    self._subscribers.remove(sub)


def _call_soon(sub: _Subscriber, batch: KvEventBatch | None) -> None:
    try:
        sub.loop.call_soon_threadsafe(sub.offer, batch)
    except RuntimeError:  # its loop is closed: the subscriber is gone
        pass
