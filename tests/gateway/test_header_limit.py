"""--max-header-bytes on the gateway process, through raw sockets: a request head over the limit gets 431
and the connection closes, whether it comes in one read or in many small ones; a head just under it, and
a small head with a large body in the same read, are served. The engine is the fake one."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.gateway.conftest import MODEL
from tests.support.fake_engine import FakeEngine
from tests.support.processes import start_gateway

pytestmark = pytest.mark.integration

LIMIT = 16 * 1024


@pytest.fixture(scope="module")
def gateway():
    with FakeEngine(MODEL) as fake:
        with start_gateway(fake.address, "--max-header-bytes", str(LIMIT)) as process:
            yield process


def head(size: int, path: str = "/health", method: str = "GET", extra: bytes = b"") -> bytes:
    """A request head of exactly `size` bytes (an X-Pad header fills it)."""
    start = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode() + extra
    filler = size - len(start) - len(b"X-Pad: \r\n\r\n")
    return start + b"X-Pad: " + b"a" * filler + b"\r\n\r\n"


def exchange(gateway, data: bytes, piece: int | None = None) -> bytes:
    """Send `data` (all at once, or `piece` bytes per send) and read the answer until the gateway closes."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        try:
            if piece is None:
                sock.sendall(data)
            else:
                for at in range(0, len(data), piece):
                    sock.sendall(data[at : at + piece])
                    time.sleep(0.001)  # separate reads on the gateway's side, most of the time
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the rest arrived: the answer is already there
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_a_60k_head_in_one_send_gets_431(gateway):
    reply = exchange(gateway, head(60_000))
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b'"code": "request_rejected"' in reply and str(LIMIT).encode() in reply


def test_a_60k_head_in_small_pieces_gets_431(gateway):
    assert status(exchange(gateway, head(60_000), piece=512)) == 431


@pytest.mark.parametrize("size", [LIMIT + 1, LIMIT + 200])
def test_a_head_just_over_the_limit_in_one_send_gets_431(gateway, size):
    assert status(exchange(gateway, head(size))) == 431


def test_a_head_over_the_limit_with_a_body_never_reaches_the_app(gateway):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    extra = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    data = head(LIMIT + 500, "/v1/completions", "POST", extra) + body
    reply = exchange(gateway, data)
    assert status(reply) == 431 and reply.count(b"HTTP/1.1") == 1


def test_a_head_just_under_the_limit_is_served(gateway):
    for piece in (None, 512):
        reply = exchange(gateway, head(LIMIT - 64), piece)
        assert status(reply) == 200, reply[:200]


def test_a_small_head_with_a_large_body_in_one_send_is_served(gateway):
    body = json.dumps({"model": MODEL, "prompt": "x " * 20_000, "max_tokens": 1}).encode()
    extra = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    reply = exchange(gateway, head(300, "/v1/completions", "POST", extra) + body)
    assert status(reply) == 200, reply[:300]
