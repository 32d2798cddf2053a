"""The ResponseStore interface and the record it keeps per stored response, plus its in-memory form.

A record is one JSON document (the response object, its input items, the conversation a chained turn
continues); a background response also has its streamed events, kept in order for stream resume, and
can be cancelled from any replica sharing the store. What expired or was evicted reads as absent.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from conduit_gateway.errors import OpenAIError

# Event types that end a response's stream.
TERMINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled", "error"}
)
TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})

# Told the id of a response whose cancellation was requested (by any replica).
OnCancel = Callable[[str], None]


class StoreUnavailable(Exception):
    """The store cannot be reached; stored requests answer 503, unstored ones go on."""


def unavailable_error(detail: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"The response store is unavailable ({detail}); retry later, or send store: false.",
        type="server_error",
        code="response_store_unavailable",
    )


@dataclass(slots=True)
class StoredResponse:
    """What the store keeps of one response."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    # The conversation after this turn (without instructions) as engine chat messages in JSON form.
    conversation: list[dict[str, Any]] = field(default_factory=list)
    # The replica running it (background responses; cancel signals go there).
    owner: str | None = None
    # The name of the API key that made it: other keys see it as absent (None: no keys configured).
    key: str | None = None

    @property
    def id(self) -> str:
        return self.response["id"]

    def to_json(self) -> str:
        return json.dumps(
            {
                "response": self.response,
                "input_items": self.input_items,
                "conversation": self.conversation,
                "owner": self.owner,
                "key": self.key,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredResponse:
        data = json.loads(text)
        return cls(
            data["response"], data["input_items"], data["conversation"], data.get("owner"), data.get("key")
        )


class ResponseStore(ABC):
    """Where stored responses live; one instance per gateway app."""

    # The replica id cancel signals are addressed to.
    replica: str

    async def start(self, on_cancel: OnCancel) -> None:  # noqa: B027 (a store may need no start)
        """Begin receiving cancel requests addressed to this replica's background responses."""

    async def close(self) -> None:  # noqa: B027
        """Release connections and tasks."""

    @abstractmethod
    async def put(self, record: StoredResponse) -> None:
        """Write (or overwrite) the record; raise StoreUnavailable."""

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None when unknown, expired or evicted; raise StoreUnavailable."""

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Remove the record and its events; True when it existed."""

    @abstractmethod
    async def append_events(
        self, response_id: str, events: list[dict[str, Any]], record: StoredResponse | None = None
    ) -> None:
        """Add streamed events (in sequence order) of a background response, and write `record`
        (if given) with them, in one round trip."""

    @abstractmethod
    def follow(self, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """The events with sequence_number > `after`, then the live ones, until a terminal event (or
        until the record is terminal and no more events come)."""

    @abstractmethod
    async def request_cancel(self, record: StoredResponse) -> bool:
        """Signal the replica running `record` to cancel it; False when no replica received it."""


@dataclass(slots=True)
class _MemoryEntry:
    text: str
    expires_at: float
    events: list[dict[str, Any]] = field(default_factory=list)
    event_bytes: int = 0

    @property
    def size(self) -> int:
        return len(self.text) + self.event_bytes


class MemoryResponseStore(ResponseStore):
    """One gateway's store: records in process memory, the oldest evicted beyond `max_bytes`."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica = "local"
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _MemoryEntry] = OrderedDict()
        self._bytes = 0
        self._changed = asyncio.Condition()
        self._version = 0  # bumped on every change; a follower waits for it to move
        self._on_cancel: OnCancel | None = None

    @property
    def bytes_used(self) -> int:
        return self._bytes

    async def start(self, on_cancel: OnCancel) -> None:
        self._on_cancel = on_cancel

    def _live(self, response_id: str) -> _MemoryEntry | None:
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires_at <= self._clock():
            self._drop(response_id)
            return None
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def _evict(self) -> None:
        now = self._clock()
        for response_id in [rid for rid, entry in self._entries.items() if entry.expires_at <= now]:
            self._drop(response_id)
        while self._bytes > self._max_bytes and len(self._entries) > 1:
            self._drop(next(iter(self._entries)))

    async def put(self, record: StoredResponse) -> None:
        entry = self._live(record.id)
        text = record.to_json()
        if entry is None:
            entry = self._entries[record.id] = _MemoryEntry(text, self._clock() + self._ttl_s)
            self._bytes += len(text)
        else:
            self._bytes += len(text) - len(entry.text)
            entry.text = text
            entry.expires_at = self._clock() + self._ttl_s
            self._entries.move_to_end(record.id)
        self._evict()
        await self._notify()

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._live(response_id)
        return None if entry is None else StoredResponse.from_json(entry.text)

    async def delete(self, response_id: str) -> bool:
        existed = self._live(response_id) is not None
        self._drop(response_id)
        await self._notify()
        return existed

    async def append_events(
        self, response_id: str, events: list[dict[str, Any]], record: StoredResponse | None = None
    ) -> None:
        if record is not None:
            await self.put(record)
        entry = self._live(response_id)
        if entry is None:
            return  # evicted while running: the response goes on unstored
        entry.events.extend(events)
        added = sum(len(json.dumps(event, ensure_ascii=False)) for event in events)
        entry.event_bytes += added
        self._bytes += added
        self._evict()
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def follow(self, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        position = 0
        while True:
            seen = self._version
            entry = self._live(response_id)
            if entry is None:
                return
            events = entry.events
            while position < len(events):
                event = events[position]
                position += 1
                if event["sequence_number"] > after:
                    yield event
                if event["type"] in TERMINAL_EVENTS:
                    return
            if json.loads(entry.text)["response"]["status"] in TERMINAL_STATUSES:
                return
            async with self._changed:
                await self._changed.wait_for(lambda seen=seen: self._version != seen)

    async def request_cancel(self, record: StoredResponse) -> bool:
        if self._on_cancel is None:
            return False
        self._on_cancel(record.id)
        return True
