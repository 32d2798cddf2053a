"""Server-Sent Events: chunk encoding (`data: {json}`) and a response that stops on client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.protocol import BODY_WRITER, BodyWriter, CancelledOnDisconnect
from conduit_gateway.race import finished_first

DONE_EVENT = "data: [DONE]\n\n"
T = TypeVar("T")
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
# The compact JSON of any value, as every chunk is encoded.
json_value = _dumps
# What `_dumps` makes of a string (the same C function it calls), for JSON written by hand.
json_string = json.encoder.encode_basestring


class RawJson(str):
    """A value already encoded as JSON (a choice a handler renders itself): written as it is."""

    __slots__ = ()


def _choices_json(choices: list[Any]) -> str:
    if not any(type(choice) is RawJson for choice in choices):
        return _dumps(choices)
    return "[" + ",".join(c if type(c) is RawJson else _dumps(c) for c in choices) + "]"


class ChunkEncoder:
    """Builds each chunk's JSON once: the fields every chunk of a request shares are encoded up front."""

    def __init__(self, *, id: str, object: str, created: int, model: str, usage_mode: str) -> None:
        # usage_mode: "none" (no usage key), "final" (null until the last chunk), "running" (every chunk).
        self._head = (
            f'data: {{"id":{_dumps(id)},"object":{_dumps(object)},"created":{created},'
            f'"model":{_dumps(model)},"system_fingerprint":null,"choices":'
        )
        self._usage_mode = usage_mode
        # What follows the choices of an event without running usage.
        self._tail = "}\n\n" if usage_mode == "none" else ',"usage":null}\n\n'

    def chunk(self, choices: list[dict[str, Any] | RawJson], usage: Callable[[], dict[str, Any]]) -> str:
        """One event; `usage` is only called when running usage is on."""
        return self._event(_choices_json(choices), usage)

    def one(self, choice: dict[str, Any] | RawJson, usage: Callable[[], dict[str, Any]]) -> str:
        """`chunk([choice], usage)`: the event of one choice, as most are."""
        return self._event(f"[{choice if type(choice) is RawJson else _dumps(choice)}]", usage)

    def text_event(self, before: str, after: str) -> tuple[str, str] | None:
        """The parts of `one(choice)` around a text whose choice JSON is `before` + text + `after`; None
        with running usage (each event has its own)."""
        if self._usage_mode == "running":
            return None
        return f"{self._head}[{before}", f"{after}]{self._tail}"

    def _event(self, choices_json: str, usage: Callable[[], dict[str, Any]]) -> str:
        if self._usage_mode == "running":
            return f'{self._head}{choices_json},"usage":{_dumps(usage())}}}\n\n'
        return f"{self._head}{choices_json}{self._tail}"

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        """The last chunk of `stream_options.include_usage`: no choices, the request's usage."""
        return f'{self._head}[],"usage":{_dumps(usage)}}}\n\n'


class ClientPace:
    """Shared by a streamed response and the source of its events: whether the client reads slower
    than it is written to (http/protocol.py's BodyWriter.behind), so that the source merges what is
    pending into fewer events. Never behind without a body writer (another server than ours)."""

    __slots__ = ("_writer",)

    # While the client is behind, how often to look again, and for how long at most, before writing.
    POLL_S = 0.002
    WAIT_S = 0.1

    def __init__(self) -> None:
        self._writer: BodyWriter | None = None

    def attach(self, writer: BodyWriter) -> None:
        self._writer = writer

    @property
    def writer(self) -> BodyWriter | None:
        """The response's body writer, once the response has started on our server."""
        return self._writer

    @property
    def behind(self) -> bool:
        return self._writer is not None and self._writer.behind

    async def caught_up(self) -> None:
        """Return once the client has read what it was behind on (WAIT_S at most): what arrives
        meanwhile goes out with it in one event."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.WAIT_S
        while self.behind and loop.time() < deadline:
            await asyncio.sleep(self.POLL_S)


def error_event(error: OpenAIError) -> str:
    """An error inside a started stream: the OpenAI SDKs raise APIError when an event has an `error` key."""
    return f"data: {_dumps(error.body())}\n\n"


class EventStreamResponse(StreamingResponse):
    """Streams `events` as text/event-stream; a client disconnect cancels the producer at once.

    Starlette's StreamingResponse only notices a disconnect on its next write (ASGI >= 2.4) and leaves
    closing the generator to the garbage collector; here the generator is always closed before
    `on_close` runs, so its `finally` (which cancels the engine streams) runs promptly.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], None] | None = None,
        pace: ClientPace | None = None,
    ) -> None:
        super().__init__(
            events, status_code=200, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._events = events
        self._on_close = on_close
        self._pace = pace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = scope.get("extensions", {}).get(BODY_WRITER)
        outcome: Exception | None = None
        try:
            await unless_disconnected(scope, receive, self._produce(send, writer))
        except Exception as exc:
            outcome = exc
        finally:
            try:
                await self._events.aclose()  # type: ignore[attr-defined]
            finally:
                self._close()
        if outcome is not None and not isinstance(outcome, OSError):
            # OSError: the client went away mid-write, which is not the server's failure.
            raise outcome

    async def _produce(self, send: Send, writer: BodyWriter | None) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if writer is not None and writer.usable:
            # Events go straight onto the connection (http/protocol.py), the same bytes `send` writes.
            if self._pace is not None:
                self._pace.attach(writer)
            async for event in self._events:
                await writer.write(event.encode("utf-8"))
        else:
            async for event in self._events:
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
        # Done before the response ends, so a client that sends its next request on [DONE] finds the
        # slot already free.
        self._close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


async def unless_disconnected(scope: Scope, receive: Receive, work: Awaitable[T]) -> tuple[T | None, bool]:
    """Run `work` unless the client goes away first, which cancels it: (what it returned, False), or
    (None, True) once the client has gone and `work` has ended. On our server the connection says when
    (CancelledOnDisconnect: no task of its own); on another, ASGI's http.disconnect, waited for beside a
    task running `work`."""
    writer = scope.get("extensions", {}).get(BODY_WRITER)
    if writer is not None:
        with CancelledOnDisconnect(writer):
            return await work, False
        return None, True
    task = asyncio.ensure_future(work)
    try:
        if await finished_first(task, wait_for_disconnect(receive)):
            return task.result(), False
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None, True


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone away (its ASGI channel says http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
