"""Following one engine's SubscribeKvEvents stream into the gateway's KV index (for kv_aware).

The subscriber reads the snapshot into a fresh set and installs it only when it is complete, then applies
each batch as it arrives. A batch whose sequence number is not the last one + 1, a broken stream, an
engine restart (a new stream with a new engine_id) or `restart()` (the node was ejected) make the index
forget the engine; the subscriber then subscribes again (waiting for the channel while the engine is down,
backing off while it refuses), and the engine counts again once its new snapshot is in. Batches are applied
as they come on the event loop; routing reads the index between them and never waits for a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from conduit.engine.v1 import engine_pb2
from conduit_gateway.routing.kv_index import EngineBlocks, KvIndex

log = logging.getLogger(__name__)

# Opens the engine's SubscribeKvEvents stream.
Subscribe = Callable[[], grpc.aio.UnaryStreamCall]


class EventGapError(Exception):
    """The stream skipped a batch (or sent one out of place): what the index holds is no longer exact."""


class KvEventSubscriber:
    def __init__(
        self,
        address: str,
        subscribe: Subscribe,
        index: KvIndex,
        backoff_s: float,
        max_backoff_s: float,
    ) -> None:
        self.address = address
        self._subscribe = subscribe
        self._index = index
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._subscriptions = 0

    async def run(self) -> None:
        """Follow the engine's events until cancelled."""
        backoff = self._backoff_s
        while True:
            try:
                if await self._follow():
                    backoff = self._backoff_s  # a snapshot arrived: the engine answers
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    log.info("KV events of %s: %s: %s", self.address, exc.code().name, exc.details())
            except EventGapError as exc:
                log.warning("KV events of %s: %s; subscribing again", self.address, exc)
            finally:
                self._call = None
                self._index.forget(self.address)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    def restart(self) -> None:
        """Forget the engine's blocks now and subscribe again (its node left the rotation)."""
        self._index.forget(self.address)
        if self._call is not None:
            self._call.cancel()

    async def _follow(self) -> bool:
        """One subscription; True when its snapshot completed."""
        call = self._call = self._subscribe()
        entry = self._index.engine(self.address)
        if self._subscriptions:
            entry.resubscribes += 1
        self._subscriptions += 1
        staging: set[bytes] = set()
        complete = False
        while True:
            batch = await call.read()
            if batch is grpc.aio.EOF:
                return complete
            if batch.snapshot:
                if complete:
                    raise EventGapError("a snapshot batch after the snapshot ended")
                for event in batch.events:
                    if len(staging) < self._index.max_blocks_per_engine:
                        staging.add(event.stored.block_hash)
                    else:
                        entry.dropped += 1
                if batch.snapshot_done:
                    entry.hashes, entry.current, complete = staging, True, True
                    entry.engine_id, entry.sequence = batch.engine_id, batch.sequence
                    _note_lag(entry, batch)
                    log.info("KV index of %s: snapshot of %d blocks", self.address, len(staging))
                continue
            if not complete:
                raise EventGapError("a live batch before the snapshot ended")
            if batch.sequence != entry.sequence + 1 or batch.engine_id != entry.engine_id:
                raise EventGapError(f"batch {batch.sequence} after {entry.sequence}")
            self._apply(entry, batch)

    def _apply(self, entry: EngineBlocks, batch: engine_pb2.KvEventBatch) -> None:
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                self._index.store(entry, event.stored.block_hash)
            elif kind == "removed":
                for block_hash in event.removed.block_hashes:
                    entry.hashes.discard(block_hash)
            elif kind == "cleared":
                entry.hashes.clear()
        entry.sequence = batch.sequence
        _note_lag(entry, batch)


def _note_lag(entry: EngineBlocks, batch: engine_pb2.KvEventBatch) -> None:
    entry.lag_s = max(0.0, time.time() - batch.created_unix_ms / 1000)
