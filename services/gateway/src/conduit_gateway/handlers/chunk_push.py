"""A streamed response's chunks written as the engine's messages arrive, without waking its handler.

Read by the handler, each token costs a wake-up: the message's future, the handler's task step, and a
trip up through the stream and event generators. While the handler waits on its only stream's next
message and the client keeps up, a message that just adds tokens needs none of that: the stream pushes
it (routing/generate_mux.py), relayed and accepted by each stream layer as a read would, to `ChunkPush`,
which shapes its events with the handler's own `_message_events` and writes them at once. Everything
else is read as before: a choice's last message, one that arrives while the client is behind (merged
with what follows, handlers/coalesce.py) or while the connection takes no more, and every end or error.

Once the only choice is open and its text needs no shaping (no parsers, no logprobs: the handler's
`text_delta`), a message that just adds text needs none of the handler's hooks either: its event is the
text's JSON string between two fixed parts, and its token ids and text are read once for every layer
(`take_tokens`, routing/generate_mux.py's TokenPush).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from conduit.engine.v1 import engine_pb2
from conduit_gateway.http.protocol import BodyWriter
from conduit_gateway.http.sse import json_string


@dataclass(frozen=True, slots=True)
class TextEvents:
    """How the handler's read loop handles a message that only adds text to the only choice, once that
    choice is open and no hook shapes its text (ChunkedHandler.text_delta): the event is `before` + the
    text's JSON string + `after`, the text is kept in `texts`, and `count` takes the message's usage."""

    before: bytes
    after: bytes
    texts: list[str]
    count: Callable[[engine_pb2.GenerateResponse], None]


class ChunkPush:
    """The push of one streamed response's only stream (routing/generate_mux.py's TokenPush)."""

    __slots__ = ("_events", "_writer", "_n", "_context", "_text_events", "_text", "takes_tokens")

    def __init__(
        self,
        events: Callable[[engine_pb2.GenerateResponse], str],
        writer: BodyWriter,
        n: int,
        text_events: Callable[[], TextEvents | Literal[False] | None] | None = None,
    ) -> None:
        self._events = events  # a message's events, as the handler's read loop makes them
        self._writer = writer
        self._n = n
        # Made in the handler's task: its context (request id, trace) is the one the events are made in,
        # not that of the task that receives the engine's batches.
        self._context = contextvars.copy_context()
        # Asked after each message taken whole until it answers: TextEvents (then `take_tokens` writes the
        # rest) or False (never: the choice's text always needs the handler's hooks).
        self._text_events = text_events
        self._text: TextEvents | None = None
        self.takes_tokens = False

    def accepts(self, message: engine_pb2.GenerateResponse) -> bool:
        # A bad choice index is left for the read loop, which answers it with an error event; a client
        # that is behind, for the read loop's coalescing (http/sse.py ClientPace).
        return not message.finished and message.index < self._n and self._writer.keeping_up

    def take(self, message: engine_pb2.GenerateResponse) -> None:
        events = self._context.run(self._events, message)
        if events:
            self._writer.write_now(events.encode("utf-8"))
        if self._text_events is not None:
            answer = self._text_events()
            if answer is False:
                self._text_events = None
            elif answer is not None:
                self._text, self._text_events, self.takes_tokens = answer, None, True

    def take_tokens(self, message: engine_pb2.GenerateResponse, token_ids: Sequence[int], text: str) -> None:
        # What the handler's _message_events does with such a message, without its hooks.
        shape = self._text
        assert shape is not None
        shape.count(message)
        if text:
            self._writer.write_parts_now(shape.before, json_string(text).encode(), shape.after)
            shape.texts.append(text)
