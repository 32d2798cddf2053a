"""A stream the gateway aborted (its client left) ends where it is: it never moves to another engine and
never opens a next part, whatever its engine does after the Abort."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.migration import MigratingStream, Migrations
from conduit_gateway.handlers.streams import StreamLost

pytestmark = pytest.mark.unit


def message(tokens: int, finish: int = engine_pb2.FINISH_REASON_UNSPECIFIED) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(
        request_id="r",
        index=0,
        token_ids=[7],
        text="x",
        usage=engine_pb2.Usage(prompt_tokens=5, completion_tokens=tokens),
        finished=finish != engine_pb2.FINISH_REASON_UNSPECIFIED,
        finish_reason=finish,
    )


class Scripted:
    """An engine stream that returns `then` (messages, and an error or None to end) after its first."""

    prompt_index = 0

    def __init__(self, then: list[engine_pb2.GenerateResponse | BaseException | None]) -> None:
        self.first = message(1)
        self.then = then
        self.aborted = False
        self.token_gaps = None

    async def read(self) -> engine_pb2.GenerateResponse | None:
        item = self.then.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


def broken_call(failure: str) -> BaseException:
    """How a stream breaks: its node lost (the health watch broke), or its call UNAVAILABLE."""
    if failure == "lost":
        return StreamLost("127.0.0.1:1", "watch broke")
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")


def migrating(inner: Scripted, reopened: list[int]) -> MigratingStream:
    async def reopen(index, request, exclude):
        reopened.append(index)
        raise AssertionError("an aborted stream must not move")

    request = engine_pb2.GenerateRequest(request_id="r")
    return MigratingStream(request, inner, Migrations(3, reopen, lambda migration: None))


def test_an_aborted_stream_whose_engine_then_fails_raises_rather_than_moving():
    broken = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")
    inner = Scripted([message(2), broken])
    reopened: list[int] = []
    stream = migrating(inner, reopened)

    async def drain():
        await stream.abort()
        assert (await stream.read()).usage.completion_tokens == 2
        with pytest.raises(grpc.aio.AioRpcError):
            await stream.read()

    asyncio.run(drain())
    assert inner.aborted
    assert reopened == []


def test_an_aborted_stream_handed_back_by_a_draining_engine_ends_there():
    inner = Scripted([message(3, engine_pb2.FINISH_REASON_MIGRATE), None])
    reopened: list[int] = []
    stream = migrating(inner, reopened)

    async def drain():
        await stream.abort()
        last = await stream.read()
        assert last.usage.completion_tokens == 3 and not last.finished  # relayed as handed back
        assert await stream.read() is None

    asyncio.run(drain())
    assert reopened == []


@pytest.mark.parametrize("failure", ["lost", "unavailable"])
def test_a_stream_that_breaks_after_its_last_choice_finished_ends_without_moving(failure):
    """The engine died between a choice's final message and the stream's end: the client has the whole
    output, so the stream ends; moving it would start the request again from nothing (a continuation
    without choices is a new request) and send the client its output twice."""
    broken = broken_call(failure)
    inner = Scripted([message(2, engine_pb2.FINISH_REASON_LENGTH), broken])
    reopened: list[int] = []
    stream = migrating(inner, reopened)

    async def read_all():
        assert (await stream.read()).finished
        assert await stream.read() is None

    asyncio.run(read_all())
    assert reopened == []


@pytest.mark.parametrize("failure", ["lost", "unavailable"])
def test_a_stream_handed_back_whose_call_then_breaks_moves_as_a_drain(failure):
    """A draining engine hands the stream back, then stops its server: the call (or the node's health
    watch, which cancels it) breaks before the stream's end is read. The move is the drain's."""
    broken = broken_call(failure)
    inner = Scripted([message(3, engine_pb2.FINISH_REASON_MIGRATE), broken])
    continued = Scripted([None])
    moves = []

    async def reopen(index, request, exclude):
        return continued

    request = engine_pb2.GenerateRequest(request_id="r")
    stream = MigratingStream(request, inner, Migrations(3, reopen, moves.append))

    async def read_all():
        assert not (await stream.read()).finished  # handed back: relayed as not finished
        await stream.read()  # the continuation's first message

    asyncio.run(read_all())
    assert [move.reason for move in moves] == ["drain"]
