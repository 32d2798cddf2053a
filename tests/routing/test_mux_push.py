"""A MuxCall's push (routing/generate_mux.py), on plain objects: a message goes to the push only while the
reader waits on its read and the push accepts it, so the reader sees every other message, in order; a
push that fails is raised by the next read, and the request can still be cancelled on the engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.routing.generate_mux import MuxCall

pytestmark = pytest.mark.unit


class Session:
    """What a MuxCall tells its GenerateStream session: the tags it cancels."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def cancel(self, tag: int) -> None:
        self.cancelled.append(tag)


class Taker:
    """A push that takes every unfinished message (or fails on the text "boom")."""

    def __init__(self) -> None:
        self.taken: list[str] = []

    def accepts(self, message: engine_pb2.GenerateResponse) -> bool:
        return not message.finished

    def take(self, message: engine_pb2.GenerateResponse) -> None:
        if message.text == "boom":
            raise ValueError("the push failed")
        self.taken.append(message.text)


def message(text: str, finished: bool = False) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(text=text, finished=finished)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_messages_arriving_while_the_reader_waits_are_pushed_and_the_rest_read_in_order():
    async def run() -> tuple[list[str], list[str]]:
        call, push = MuxCall(Session(), 1), Taker()
        assert call.push_to(push)
        read: list[str] = []
        call.deliver(message("a"))  # nobody reads yet: held for the read
        call.deliver(message("b"))
        reader = asyncio.ensure_future(call.read())
        read.append((await reader).text)
        read.append((await call.read()).text)
        reader = asyncio.ensure_future(call.read())
        await settle()  # the reader waits now
        call.deliver(message("c"))  # pushed
        call.deliver(message("d"))  # pushed: the reader still waits
        call.deliver(message("e", finished=True))  # not accepted: the read returns it
        call.deliver(message("f"))  # the reader was woken and has not read yet: held, after "e"
        read.append((await reader).text)
        read.append((await call.read()).text)
        call.end(grpc.StatusCode.OK.value[0], "")
        assert await call.read() is grpc.aio.EOF
        return read, push.taken

    read, taken = asyncio.run(run())
    assert read == ["a", "b", "e", "f"]
    assert taken == ["c", "d"]


def test_without_a_push_every_message_is_read():
    async def run() -> list[str]:
        call, push = MuxCall(Session(), 1), Taker()
        call.push_to(push)
        call.push_to(None)
        reader = asyncio.ensure_future(call.read())
        await settle()
        call.deliver(message("a"))
        return [(await reader).text], push.taken

    assert asyncio.run(run()) == (["a"], [])


def test_a_failed_push_is_raised_by_the_next_read_and_the_request_is_still_cancelled_on_the_engine():
    async def run() -> tuple[Session, Taker]:
        session, push = Session(), Taker()
        call = MuxCall(session, 7)
        call.push_to(push)
        reader = asyncio.ensure_future(call.read())
        await settle()
        call.deliver(message("boom"))
        with pytest.raises(ValueError, match="the push failed"):
            await reader
        reader = asyncio.ensure_future(call.read())
        await settle()
        call.deliver(message("after"))  # the push is off once it failed: read
        assert (await reader).text == "after"
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        return session, push

    session, push = asyncio.run(run())
    assert session.cancelled == [7]
    assert push.taken == []
