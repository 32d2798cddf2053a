"""CancelledOnDisconnect (http/protocol.py), on a stand-in for uvicorn's request cycle: the client going
away cancels the work inside the block and that cancellation ends at the block; a cancellation from
elsewhere goes on; a client already gone cancels at once; the block puts back the watch it replaced.
`unless_disconnected` (http/sse.py) uses it on our server and ASGI's http.disconnect on another.
The whole flow (a client leaving before its first token, mid-stream, a non-streamed request: the engine
told to cancel) is tested through the real gateway in test_faults.py and test_messages_gateway.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from conduit_gateway.http.protocol import BODY_WRITER, BodyWriter, CancelledOnDisconnect
from conduit_gateway.http.sse import unless_disconnected

pytestmark = pytest.mark.unit


def writer() -> tuple[BodyWriter, SimpleNamespace]:
    transport = SimpleNamespace(get_extra_info=lambda name: None)
    cycle = SimpleNamespace(transport=transport, disconnected=False)
    return BodyWriter(cycle), cycle  # type: ignore[arg-type]


def leave(body_writer: BodyWriter, cycle: SimpleNamespace) -> None:
    """What the protocol does when the connection is lost mid-response."""
    cycle.disconnected = True
    body_writer.lost()


def test_the_client_leaving_cancels_the_work_and_the_cancellation_ends_at_the_block():
    async def main() -> tuple[bool, bool, int]:
        body_writer, cycle = writer()
        finished = False
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, leave, body_writer, cycle)
        with CancelledOnDisconnect(body_writer) as watch:
            await asyncio.sleep(60)
            finished = True
        await asyncio.sleep(0)  # the task is not cancelled any more
        return watch.gone, finished, asyncio.current_task().cancelling()

    assert asyncio.run(main()) == (True, False, 0)


def test_work_that_ends_first_is_untouched_and_a_later_leaving_cancels_nothing():
    async def main() -> tuple[bool, str]:
        body_writer, cycle = writer()
        with CancelledOnDisconnect(body_writer) as watch:
            await asyncio.sleep(0)
        leave(body_writer, cycle)
        await asyncio.sleep(0.01)
        return watch.gone, "went on"

    assert asyncio.run(main()) == (False, "went on")


def test_a_cancellation_from_elsewhere_goes_on_even_when_the_client_left_too():
    async def work(body_writer: BodyWriter, cycle: SimpleNamespace) -> None:
        with CancelledOnDisconnect(body_writer):
            asyncio.current_task().cancel()  # say, the server shutting down
            leave(body_writer, cycle)
            await asyncio.sleep(60)

    async def main() -> None:
        await asyncio.create_task(work(*writer()))

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_a_client_already_gone_cancels_the_block_at_once():
    async def main() -> bool:
        body_writer, cycle = writer()
        cycle.disconnected = True
        with CancelledOnDisconnect(body_writer) as watch:
            await asyncio.sleep(60)
        return watch.gone

    assert asyncio.run(asyncio.wait_for(main(), 5)) is True


def test_a_block_puts_back_the_watch_it_replaced():
    async def main() -> list[str]:
        body_writer, cycle = writer()
        seen: list[str] = []
        body_writer.on_gone(lambda: seen.append("outer"))
        with CancelledOnDisconnect(body_writer):
            await asyncio.sleep(0)
        leave(body_writer, cycle)
        return seen

    assert asyncio.run(main()) == ["outer"]


def test_unless_disconnected_on_another_server_watches_receive_and_cancels_the_work():
    """Without our protocol's body writer (another ASGI server): ASGI's http.disconnect is the signal."""

    async def main() -> tuple[tuple, tuple, list[str]]:
        seen: list[str] = []
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        async def work(result: str) -> str:
            try:
                await asyncio.sleep(0 if result == "quick" else 60)
                return result
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        first = await unless_disconnected({}, receive, work("quick"))
        asyncio.get_running_loop().call_later(0.01, left.set)
        second = await unless_disconnected({}, receive, work("slow"))
        return first, second, seen

    assert asyncio.run(main()) == (("quick", False), (None, True), ["cancelled"])


def test_unless_disconnected_on_our_server_uses_the_connection():
    async def main() -> tuple[tuple, tuple]:
        body_writer, cycle = writer()
        scope = {"extensions": {BODY_WRITER: body_writer}}

        async def never() -> dict:
            await asyncio.sleep(3600)
            return {}

        async def quick() -> str:
            return "done"

        first = await unless_disconnected(scope, never, quick())
        asyncio.get_running_loop().call_later(0.01, leave, body_writer, cycle)
        second = await unless_disconnected(scope, never, asyncio.sleep(60, "late"))
        return first, second

    assert asyncio.run(main()) == (("done", False), (None, True))
