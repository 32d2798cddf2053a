"""uvicorn's HTTP/1.1 protocol (httptools) with bounds on slow and oversized request heads.

uvicorn bounds neither how long a request's line and headers may take to arrive nor how large they may
grow (httptools buffers a header until it ends), so a client trickling bytes (slowloris) could hold a
connection and its memory forever. Here each head must arrive within `header_timeout_s` of the
connection or of its first byte (else 408) and fit `max_header_bytes` (else 431); bodies are bounded
by BodyLimitMiddleware.

The size is checked twice, so that where the packets split the head changes nothing: the bytes of a head
still incomplete after a read (what httptools is buffering), and the parsed request line and headers as
the parser hands them over (a whole head in one read, or the rest of one, is parsed within that read). A
head over the limit never reaches the app: the connection answers 431 and closes.

Each request's scope also carries a `BodyWriter` (extension "conduit.body_writer"): streamed responses
write their body chunks through it straight onto the connection, as uvicorn's own `send` would write
them, without a trip through every middleware's `send` per event, and can see whether the client is
behind.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from conduit_gateway.errors import OpenAIError

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}

BODY_WRITER = "conduit.body_writer"

# Bytes of a connection the kernel holds that have not reached the client (Linux: the send queue less
# what the peer acknowledged); past this the client is behind. A client that keeps up leaves it near 0.
BEHIND_BYTES = 32 * 1024
_OUTQ = getattr(termios, "TIOCOUTQ", None)


def _unsent(fd: int) -> int:
    if _OUTQ is None or fd < 0:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(fd, _OUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class BodyWriter:
    """Writes the middle chunks of a started chunked response onto its connection, the bytes uvicorn's
    `send` writes for `{"type": "http.response.body", "body": ..., "more_body": True}`; the response's
    start and end still go through `send` (the middleware see both)."""

    __slots__ = ("_cycle", "_transport", "_fd", "_written", "_behind", "_on_gone")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._on_gone: Callable[[], None] | None = None
        self._transport = cycle.transport
        sock = self._transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        self._written = 0  # bytes written since `behind` last looked
        self._behind = False  # what it saw then

    @property
    def usable(self) -> bool:
        """The response has started, chunked, and has not ended: `write` may be used."""
        cycle = self._cycle
        return cycle.response_started and cycle.chunked_encoding is True and not cycle.response_complete

    @property
    def behind(self) -> bool:
        """The client reads slower than it is written to: bytes wait in the connection's buffer (the
        socket took no more), or over BEHIND_BYTES wait in the kernel's. What is written now reaches
        it only after those, so merging pending events into one costs it no time. Looked at again
        (a system call) once a quarter of BEHIND_BYTES more is written, or at once while behind."""
        if not self._behind and self._written < BEHIND_BYTES // 4:
            return False
        self._written = 0
        transport = self._transport
        self._behind = not transport.is_closing() and (
            transport.get_write_buffer_size() > 0 or _unsent(self._fd) > BEHIND_BYTES
        )
        return self._behind

    async def write(self, body: bytes) -> None:
        """One chunk; waits while the connection's buffer is over its high-water mark, like `send`, and
        does nothing once the client has gone."""
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if not cycle.disconnected:
            self.write_now(body)

    @property
    def keeping_up(self) -> bool:
        """`write_now` may be used (the response has not ended, the client is there and the connection's
        buffer takes more: `write` would not wait) and the client is not `behind`: what is written now
        reaches it at once."""
        cycle = self._cycle
        if cycle.flow.write_paused or cycle.disconnected or cycle.response_complete:
            return False
        return not self.behind

    def write_now(self, body: bytes) -> None:
        """`write` of a chunk when `keeping_up`: without waiting."""
        if body:
            self._written += len(body)
            self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def on_gone(self, callback: Callable[[], None] | None) -> Callable[[], None] | None:
        """Call `callback` (soon, if it already has) once the client goes away before the response ends;
        None: call nothing. Returns the callback it replaces."""
        previous, self._on_gone = self._on_gone, callback
        if callback is not None and self._cycle.disconnected:
            asyncio.get_running_loop().call_soon(self.lost)
        return previous

    def lost(self) -> None:
        """The connection is gone (the protocol's connection_lost)."""
        callback = self._on_gone
        if callback is not None and self._cycle.disconnected:
            self._on_gone = None
            callback()

    def write_parts_now(self, head: bytes, body: bytes, tail: bytes) -> None:
        """`write_now(head + body + tail)`, joined once, into the chunk's framing."""
        size = len(head) + len(body) + len(tail)
        self._written += size
        self._transport.write(b"%x\r\n%b%b%b\r\n" % (size, head, body, tail))


class CancelledOnDisconnect:
    """`with CancelledOnDisconnect(writer):` the current task is cancelled if the client goes away
    meanwhile, and that cancellation ends at the block's end (`gone` says it happened), as an
    `asyncio.timeout` ends its own: a cancellation from elsewhere goes on. No task of its own, where
    waiting for ASGI's http.disconnect beside the work takes two tasks and a wait per request."""

    __slots__ = ("_writer", "_task", "_previous", "gone")

    def __init__(self, writer: BodyWriter) -> None:
        self._writer = writer
        self.gone = False

    def __enter__(self) -> CancelledOnDisconnect:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._previous = self._writer.on_gone(self._cancel)
        return self

    def _cancel(self) -> None:
        self.gone = True
        self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        self._writer.on_gone(self._previous)
        if not self.gone or self._task.uncancel() > 0:
            return False
        return exc_type is not None and issubclass(exc_type, asyncio.CancelledError)


class BoundedHttpProtocol(HttpToolsProtocol):
    """One connection; `max_header_bytes` and `header_timeout_s` are set per server by
    `bounded_http_protocol` (uvicorn builds the protocol from a class)."""

    max_header_bytes = 16 * 1024
    header_timeout_s = 10.0
    _head_bytes = 0  # raw bytes received while the current head is incomplete
    _parsed_head = 0  # bytes of the current head's request line and headers, as parsed
    _oversized = False  # a head went over the limit: nothing more of this connection reaches the app
    _reading_head = True
    _head_timer: asyncio.TimerHandle | None = None
    _writer: BodyWriter | None = None  # the current request's

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn builds each access line's arguments before the logger's level drops it.
        self.access_log = self.access_log and self.access_logger.isEnabledFor(logging.INFO)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._oversized:
            return
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._oversized or (self._reading_head and self._head_bytes > self.max_header_bytes):
            self._oversized = True
            self._refuse(431, f"The request line and headers exceed {self.max_header_bytes} bytes.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_head = len(b"GET  HTTP/1.1\r\n\r\n")  # the request line's and the head's fixed bytes
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))  # a URL split across reads comes in pieces
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + len(b": \r\n"))
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._parsed_head += size
        if self._parsed_head > self.max_header_bytes:
            self._oversized = True  # answered once this read is parsed (data_received)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        if not self._oversized:
            super().on_headers_complete()
            if self.cycle is not None:
                self._writer = BodyWriter(self.cycle)
                self.scope.setdefault("extensions", {})[BODY_WRITER] = self._writer

    def on_body(self, body: bytes) -> None:
        if not self._oversized:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._oversized:
            super().on_message_complete()
        self._reading_head, self._head_bytes = True, 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        if self._writer is not None:
            self._writer.lost()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._reading_head:
            self._refuse(408, f"The request headers did not arrive within {self.header_timeout_s:g} seconds.")

    def _refuse(self, status: int, message: str) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            # No response is under way on this connection: answer before closing it.
            body = OpenAIError(status, message, code="request_rejected").body_json().encode()
            head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (status, _REASONS[status])
            head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            self.transport.write(head + body)
        self.transport.close()


def bounded_http_protocol(max_header_bytes: int, header_timeout_s: float) -> type[BoundedHttpProtocol]:
    """The protocol class for uvicorn's `http=` with these bounds."""
    bounds = {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s}
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,), bounds)
