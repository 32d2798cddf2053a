"""The Redis response store, shared by every gateway replica pointed at the same Redis.

Keys (under a prefix): `resp:{id}` holds the record's JSON with the TTL; `events:{id}` is a Redis stream
of a background response's events, entry id `0-{sequence_number + 1}`, so a resume reads with XREAD
from the entry after the one the client saw and blocks for the live ones. A cancel is published on
`cancel:{replica}`, the channel of the replica running the response.

Every call is one round trip (a pipeline counts as one); `round_trips` and `bytes_written` count them.
Any Redis or socket failure becomes StoreUnavailable (the caller answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from conduit_gateway.responses.store import (
    TERMINAL_EVENTS,
    TERMINAL_STATUSES,
    OnCancel,
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

_PREFIX = "conduit:responses:"
# How long one blocking XREAD of a follower waits before it checks whether the response ended.
_FOLLOW_BLOCK_MS = 1000
_RESUBSCRIBE_S = 1.0
# Each replica refreshes a key that lives _HEARTBEAT_TTL_S; a follower of a background response whose
# replica's key is gone (the replica died) ends it as failed instead of waiting forever.
_HEARTBEAT_S = 3.0
_HEARTBEAT_TTL_S = 10


class RedisResponseStore(ResponseStore):
    def __init__(self, url: str, ttl_s: float, password: str | None = None) -> None:
        self.replica = uuid.uuid4().hex
        self._ttl_s = max(1, int(ttl_s))
        # No retries: a Redis that is down must fail the request at once (503), not after backoffs.
        self._client = redis.Redis.from_url(
            url,
            password=password,
            socket_timeout=_FOLLOW_BLOCK_MS / 1000 + 4,
            socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 0),
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.round_trips = 0
        self.bytes_written = 0

    def _key(self, response_id: str) -> str:
        return f"{_PREFIX}resp:{response_id}"

    def _events_key(self, response_id: str) -> str:
        return f"{_PREFIX}events:{response_id}"

    def _replica_key(self, replica: str) -> str:
        return f"{_PREFIX}replica:{replica}"

    async def start(self, on_cancel: OnCancel) -> None:
        await self._beat()  # alive before its first background response can exist
        self._tasks = [
            asyncio.create_task(self._receive_cancels(on_cancel)),
            asyncio.create_task(self._heartbeat()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(RedisError, OSError):
            await self._client.delete(self._replica_key(self.replica))
        await self._client.aclose()

    async def _beat(self) -> None:
        # Not through _call: heartbeats are not a request's round trips.
        try:
            await self._client.set(self._replica_key(self.replica), "1", ex=_HEARTBEAT_TTL_S)
        except (RedisError, OSError) as exc:
            log.warning("response store: heartbeat failed (%s)", exc)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(_HEARTBEAT_S)
            await self._beat()

    async def _receive_cancels(self, on_cancel: OnCancel) -> None:
        channel = f"{_PREFIX}cancel:{self.replica}"
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        on_cancel(message["data"].decode())
            except (RedisError, OSError) as exc:
                log.warning("response store: cancel subscription lost (%s); retrying", exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(_RESUBSCRIBE_S)

    async def _call(self, operation: Any) -> Any:
        self.round_trips += 1
        try:
            return await operation
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from None

    async def put(self, record: StoredResponse) -> None:
        text = record.to_json()
        self.bytes_written += len(text.encode())
        await self._call(self._client.set(self._key(record.id), text, ex=self._ttl_s))

    async def get(self, response_id: str) -> StoredResponse | None:
        text = await self._call(self._client.get(self._key(response_id)))
        return None if text is None else StoredResponse.from_json(text)

    async def delete(self, response_id: str) -> bool:
        removed = await self._call(self._client.delete(self._key(response_id), self._events_key(response_id)))
        return bool(removed)

    async def append_events(
        self, response_id: str, events: list[dict[str, Any]], record: StoredResponse | None = None
    ) -> None:
        key = self._events_key(response_id)
        # A transaction: a reader never sees the final record without the events before it.
        pipe = self._client.pipeline(transaction=True)
        for event in events:
            text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
            self.bytes_written += len(text.encode())
            pipe.xadd(key, {"e": text}, id=f"0-{event['sequence_number'] + 1}")
        if events:
            pipe.expire(key, self._ttl_s)
        if record is not None:
            text = record.to_json()
            self.bytes_written += len(text.encode())
            pipe.set(self._key(record.id), text, ex=self._ttl_s)
        await self._call(pipe.execute())

    async def follow(self, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        key = self._events_key(response_id)
        last = f"0-{after + 1}" if after >= 0 else "0-0"
        ended = False  # the record is terminal: read what is left without blocking, then stop
        while True:
            block = None if ended else _FOLLOW_BLOCK_MS
            read = await self._call(self._client.xread({key: last}, count=256, block=block))
            if read:
                for entry_id, fields in read[0][1]:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    event = json.loads(fields[b"e"])
                    yield event
                    if event["type"] in TERMINAL_EVENTS:
                        return
                continue
            if ended:
                return
            record = await self.get(response_id)
            if record is not None and record.response["status"] not in TERMINAL_STATUSES:
                await self._fail_if_orphaned(record)
            ended = record is None or record.response["status"] in TERMINAL_STATUSES

    async def _fail_if_orphaned(self, record: StoredResponse) -> None:
        """A running response whose replica no longer beats will never end: record it as failed."""
        if record.owner is None or await self._call(self._client.exists(self._replica_key(record.owner))):
            return
        record.response["status"] = "failed"
        record.response["error"] = {
            "code": "replica_gone",
            "message": "The gateway replica running this background response stopped before it finished.",
        }
        await self.put(record)

    async def request_cancel(self, record: StoredResponse) -> bool:
        if record.owner is None:
            return False
        receivers = await self._call(self._client.publish(f"{_PREFIX}cancel:{record.owner}", record.id))
        return bool(receivers)
