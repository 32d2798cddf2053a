"""A cheap SSE reader for the gateway benches: one request on its own connection, each `data:` event's
bytes handed over as they arrive, no HTTP library and no JSON parsing of its own."""

from __future__ import annotations

import asyncio
import time


class SseReader(asyncio.Protocol):
    """Writes `request` once connected; each event's bytes go to `event(data, now)` (`data` from the
    `data: ` on, `now` the perf_counter when its bytes arrived); closes on [DONE] and sets `done` when
    the connection ends. `status_ok`: the answer's status line was 200."""

    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self.request, self.done = request, done
        self.buf = b""
        self.status_ok: bool | None = None

    def event(self, data: bytes, now: float) -> None:
        raise NotImplementedError

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.buf + data
        if self.status_ok is None:
            self.status_ok = buf.startswith(b"HTTP/1.1 200")
        start = 0
        while (end := buf.find(b"\n\n", start)) >= 0:
            chunk = buf[start:end]
            start = end + 2
            at = chunk.find(b"data: ")
            if at < 0:
                continue
            if chunk.startswith(b"[DONE]", at + 6):
                self.transport.close()
                continue
            self.event(chunk[at:], now)
        self.buf = buf[start:]

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)
