"""A grpc.aio Generate call read the way a MuxCall is read (routing/generate_mux.py): what
handlers/streams.py reads an engine's messages from when the engine is not multiplexed."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from conduit.engine.v1 import engine_pb2

# Messages a stream's reader task takes off its call ahead of the handler: what one merged event of a
# client that reads slowly can carry beyond its first token (handlers/coalesce.py).
READ_AHEAD = 64


class CallReader:
    """A grpc.aio Generate call read the way a MuxCall reads (routing/generate_mux.py): `next_item()`
    returns each message, then grpc.aio.EOF or the read's error (returned, not raised); `take_ready()`
    what has arrived; `cancel()` ends it. grpc cancels a call whose read is cancelled, so one task reads
    the call for its whole life into a bounded inbox: cancelling a `next_item()` (the client left) leaves
    the call open and its message unread, for the drain that charges what the engine generated."""

    __slots__ = ("call", "_reader", "_inbox", "_held", "_cancelled")

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self._reader: asyncio.Task[None] | None = None
        self._inbox: asyncio.Queue[object] = asyncio.Queue(maxsize=READ_AHEAD)
        self._held: object = None  # the end or an error `take_ready()` took off the inbox
        self._cancelled = False

    async def read(self) -> object:
        """The next message, or grpc.aio.EOF at the end; raises the call's error."""
        item = await self.next_item()
        if isinstance(item, BaseException):
            raise item
        return item

    async def next_item(self) -> object:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        if self._cancelled and self._inbox.empty():
            return asyncio.CancelledError()  # however full the inbox was when the call was cancelled
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._pump())
        return await self._inbox.get()  # cancelling this leaves the message for the next one

    def take_ready(self) -> list[engine_pb2.GenerateResponse]:
        messages: list[engine_pb2.GenerateResponse] = []
        inbox = self._inbox
        while self._held is None and not inbox.empty():
            item = inbox.get_nowait()
            if isinstance(item, engine_pb2.GenerateResponse):
                messages.append(item)
            else:
                self._held = item  # the end, or an error: the next `next_item()` hands it over
        return messages

    def push_to(self, push: object) -> bool:
        """A Generate call's messages come through its reader task: they are only ever read."""
        return False

    def cancel(self) -> None:
        """Cancel the call (the engine sees CANCELLED and frees the request's blocks); a `next_item()`
        waiting now returns asyncio.CancelledError after what the inbox holds."""
        self.call.cancel()
        if not self._cancelled:
            self._cancelled = True
            if self._reader is not None:
                self._reader.cancel()
                self._reader = None
            with contextlib.suppress(asyncio.QueueFull):  # full: no reader is waiting (see next_item)
                self._inbox.put_nowait(asyncio.CancelledError())

    async def _pump(self) -> None:
        """Read the call to its end, handing over each message, the EOF or the read's error."""
        while True:
            try:
                message = await self.call.read()
            except (asyncio.CancelledError, Exception) as exc:  # handed over, and raised by the reader
                if not self._cancelled:
                    await self._inbox.put(exc)
                return
            await self._inbox.put(message)
            if message is grpc.aio.EOF:
                return
