"""ChunkPush (handlers/chunk_push.py) on plain objects: what it takes, what it leaves to the read loop, and
the context its events are made in."""

from __future__ import annotations

import contextvars

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.chunk_push import ChunkPush

pytestmark = pytest.mark.unit

REQUEST = contextvars.ContextVar("request", default=None)


class Writer:
    """The body writer's side ChunkPush uses."""

    def __init__(self) -> None:
        self.writable_now = True
        self.behind = False
        self.written: list[bytes] = []

    def write_now(self, body: bytes) -> None:
        self.written.append(body)


def test_a_plain_message_is_shaped_in_the_handlers_context_and_written():
    writer, seen = Writer(), []

    def events(message: engine_pb2.GenerateResponse) -> str:
        seen.append(REQUEST.get())
        return f"data: {message.text}\n\n"

    token = REQUEST.set("req-1")
    push = ChunkPush(events, writer, n=1)  # made in the handler's task
    REQUEST.reset(token)
    message = engine_pb2.GenerateResponse(text="§")
    assert push.accepts(message)
    push.take(message)  # taken in another task's context
    assert seen == ["req-1"]
    assert writer.written == ["data: §\n\n".encode()]


def test_what_the_read_loop_keeps():
    writer = Writer()
    push = ChunkPush(lambda message: "", writer, n=2)
    assert push.accepts(engine_pb2.GenerateResponse(index=1))
    assert not push.accepts(engine_pb2.GenerateResponse(finished=True))  # a choice's last message
    assert not push.accepts(engine_pb2.GenerateResponse(index=2))  # a bad index: an error event
    writer.behind = True  # a slow client: merged by the read loop
    assert not push.accepts(engine_pb2.GenerateResponse())
    writer.behind, writer.writable_now = False, False  # the connection takes no more, or is gone
    assert not push.accepts(engine_pb2.GenerateResponse())
    push.take(engine_pb2.GenerateResponse())
    assert writer.written == []  # no events, nothing written
