"""What a GenerateStream session writes (routing/generate_mux.py's _Session), on a plain stand-in for the
call: to an engine that takes batched actions, the actions of one moment go in one batch, in order, each
batch under the engine's limit, and an action too large to share one goes alone, in its turn; to one that
does not, each action is its own write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.routing.generate_mux import _Session

pytestmark = pytest.mark.unit


class Call:
    """The GenerateStream call: takes its requests' iterator; its engine never answers."""

    def __init__(self, requests: AsyncIterator[engine_pb2.GenerateStreamRequest]) -> None:
        self.requests = requests
        self._never = asyncio.get_running_loop().create_future()

    async def initial_metadata(self) -> tuple:
        return ()

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> engine_pb2.GenerateStreamBatch:
        await self._never
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._never.cancel()


def request(prompt_bytes: int = 10) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(text="x" * prompt_bytes)


def describe(action: engine_pb2.GenerateStreamRequest) -> object:
    """An open as its tag, a cancel as -tag, a batch as the list of its actions."""
    kind = action.WhichOneof("action")
    if kind == "batch":
        return [describe(each) for each in action.batch.actions]
    return action.open.tag if kind == "open" else -action.cancel


async def written(session: _Session, call: Call, count: int) -> list[object]:
    return [describe(await anext(call.requests)) for _ in range(count)]


def start(batch_bytes: int) -> tuple[_Session, list[Call]]:
    calls: list[Call] = []

    def open_stream(requests: AsyncIterator[engine_pb2.GenerateStreamRequest]) -> Call:
        calls.append(Call(requests))
        return calls[-1]

    return _Session(open_stream, lambda session, error: None, batch_bytes), calls


def test_the_actions_of_one_moment_go_in_one_batch_in_order():
    async def main() -> list[object]:
        session, (call,) = start(batch_bytes=4096)
        for tag in (1, 2, 3):
            session.open(tag, request(), [("x-request-id", f"r{tag}")])
        session.cancel(2)
        first = await written(session, call, 1)
        session.open(4, request(), [])  # after the batch was written: the next one
        session.cancel(1)
        second = await written(session, call, 1)
        session.close()
        return first + second

    assert asyncio.run(main()) == [[1, 2, 3, -2], [4, -1]]


def test_a_batch_stays_under_the_engines_limit_and_a_large_action_goes_alone_in_its_turn():
    async def main() -> list[object]:
        session, (call,) = start(batch_bytes=1000)
        for tag in (1, 2, 3, 4, 5):
            session.open(tag, request(200), [])  # about 230 bytes each: four fit a batch of 1000
        session.open(6, request(600), [])  # over half the limit: alone
        session.open(7, request(10), [])
        out = await written(session, call, 4)
        session.close()
        return out

    assert asyncio.run(main()) == [[1, 2, 3, 4], [5], 6, [7]]


def test_each_batch_written_fits_the_limit():
    async def main() -> list[int]:
        session, (call,) = start(batch_bytes=1000)
        for tag in range(1, 41):
            metadata = [("traceparent", "00-" + "a" * 50), ("x-request-id", "é" * tag)]  # 2 bytes a char
            session.open(tag, request(tag * 10), metadata)
        sizes, tags = [], []
        while len(tags) < 40:
            action = await anext(call.requests)
            sizes.append(action.ByteSize())
            got = describe(action)
            tags.extend(got if isinstance(got, list) else [got])
        session.close()
        assert tags == list(range(1, 41))
        return sizes

    assert max(asyncio.run(main())) <= 1000


def test_without_batches_each_action_is_its_own_write():
    async def main() -> list[object]:
        session, (call,) = start(batch_bytes=0)
        session.open(1, request(), [])
        session.open(2, request(), [])
        session.cancel(1)
        out = await written(session, call, 3)
        session.close()
        return out

    assert asyncio.run(main()) == [1, 2, -1]
