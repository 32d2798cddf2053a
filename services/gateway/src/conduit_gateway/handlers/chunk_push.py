"""A streamed response's chunks written as the engine's messages arrive, without waking its handler.

Read by the handler, each token costs a wake-up: the message's future, the handler's task step, and a
trip up through the stream and event generators. While the handler waits on its only stream's next
message and the client keeps up, a message that just adds tokens needs none of that: the stream pushes
it (routing/generate_mux.py), relayed and accepted by each stream layer as a read would, to `ChunkPush`,
which shapes its events with the handler's own `_message_events` and writes them at once. Everything
else is read as before: a choice's last message, one that arrives while the client is behind (merged
with what follows, handlers/coalesce.py) or while the connection takes no more, and every end or error.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

from conduit.engine.v1 import engine_pb2
from conduit_gateway.http.protocol import BodyWriter


class ChunkPush:
    """The push of one streamed response's only stream (routing/generate_mux.py's Push)."""

    __slots__ = ("_events", "_writer", "_n", "_context")

    def __init__(
        self, events: Callable[[engine_pb2.GenerateResponse], str], writer: BodyWriter, n: int
    ) -> None:
        self._events = events  # a message's events, as the handler's read loop makes them
        self._writer = writer
        self._n = n
        # Made in the handler's task: its context (request id, trace) is the one the events are made in,
        # not that of the task that receives the engine's batches.
        self._context = contextvars.copy_context()

    def accepts(self, message: engine_pb2.GenerateResponse) -> bool:
        # A bad choice index is left for the read loop, which answers it with an error event; a client
        # that is behind, for the read loop's coalescing (http/sse.py ClientPace).
        writer = self._writer
        return writer.writable_now and not message.finished and message.index < self._n and not writer.behind

    def take(self, message: engine_pb2.GenerateResponse) -> None:
        events = self._context.run(self._events, message)
        if events:
            self._writer.write_now(events.encode("utf-8"))
