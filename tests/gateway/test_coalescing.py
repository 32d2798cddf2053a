"""A client that reads slower than its tokens arrive gets them merged into fewer events, and nothing else
changes: under load (many fast streams beside it), a deliberately slow raw-socket reader with a small
receive buffer gets exactly the text, the per-token logprob entries, the finish and the usage that a fast
reader gets, in order, each once. Runs the gateway as its real process (the coalescing needs its HTTP
protocol's body writer), against the in-process fake engine."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.support.fake_engine import FakeEngine, Script
from tests.support.processes import start_gateway

pytestmark = pytest.mark.integration

MODEL = "fake-model"
FAST_STREAMS = 12
# Distinct words, a count prime to the token count's divisors: a dropped, repeated or moved token shows.
WORDS = tuple(f" w{i}:" + "x" * 40 for i in range(101))
TOKENS = {"chat": 1500, "completions": 1500}


@pytest.fixture(scope="module")
def stack():
    with FakeEngine(MODEL) as fake:
        fake.reset(Script(words=WORDS, max_tokens_cap=max(TOKENS.values())))
        with start_gateway(fake.address, "--log-level", "warning") as gateway:
            yield gateway


def _body(api: str) -> dict:
    body = {
        "model": MODEL,
        "max_tokens": TOKENS[api],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        return {**body, "messages": [{"role": "user", "content": "go"}], "logprobs": True, "top_logprobs": 2}
    return {**body, "prompt": "go", "logprobs": 5}


def _path(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


class Collected:
    """What a reader made of one stream's events."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.text = ""
        self.logprobs: list = []  # one entry per token (chat: the content entries; completions: tuples)
        self.finishes: list[str] = []
        self.usage: dict | None = None
        self.content_events = 0
        self.done = 0

    def add(self, data: str) -> None:
        assert self.done == 0, "an event after [DONE]"
        if data == "[DONE]":
            self.done += 1
            return
        event = json.loads(data)
        assert "error" not in event
        if event.get("usage"):
            assert self.usage is None, "usage twice"
            self.usage = event["usage"]
        for choice in event["choices"]:
            assert choice["index"] == 0
            assert not self.finishes, "a choice went on after its finish"
            text = choice["delta"].get("content", "") if self.api == "chat" else choice["text"]
            if text:
                self.content_events += 1
                self.text += text
            logprobs = choice["logprobs"]
            if logprobs and self.api == "chat":
                self.logprobs += logprobs["content"]
            elif logprobs:
                self.logprobs += zip(
                    logprobs["tokens"],
                    logprobs["token_logprobs"],
                    logprobs["top_logprobs"],
                    logprobs["text_offset"],
                    strict=True,
                )
            if choice["finish_reason"] is not None:
                self.finishes.append(choice["finish_reason"])


def fast_reader(url: str, api: str) -> Collected:
    collected = Collected(api)
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", _path(api), json=_body(api)) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    collected.add(line[6:])
    return collected


def slow_reader(url: str, api: str) -> Collected:
    """A raw socket with a 4 KiB receive buffer that waits a second, then reads 8 KiB every 2 ms or so."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(_body(api)).encode()
    head = (
        f"POST {_path(api)} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    raw = bytearray()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(120)
        sock.connect((host, int(port)))
        sock.sendall(head.encode() + payload)
        time.sleep(1.0)
        while data := sock.recv(8192):
            raw += data
            time.sleep(0.002)
    status, _, body = bytes(raw).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200"), status
    collected = Collected(api)
    for event in _unchunk(body).decode("utf-8").split("\n\n"):
        if event.startswith("data: "):
            collected.add(event[6:])
    return collected


def _unchunk(body: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        body = rest[size + 2 :]


def expected_text(tokens: int) -> str:
    return "".join(WORDS[step % len(WORDS)] for step in range(tokens))


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_slow_reader_gets_merged_events_with_the_same_tokens_logprobs_and_usage_as_a_fast_one(stack, api):
    results: dict[str, Collected] = {}
    errors: list[BaseException] = []

    def run(name: str, reader) -> None:
        try:
            results[name] = reader(stack.url, api)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("slow", slow_reader))]
    threads += [threading.Thread(target=run, args=(f"fast{i}", fast_reader)) for i in range(FAST_STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise errors[0]
    slow, fast = results["slow"], results["fast0"]
    tokens = TOKENS[api]
    for collected in results.values():
        assert collected.text == expected_text(tokens)
        assert len(collected.logprobs) == tokens
        assert collected.finishes == ["length"]
        assert collected.done == 1
        assert collected.usage is not None and collected.usage["completion_tokens"] == tokens
    assert slow.logprobs == fast.logprobs
    assert slow.usage == fast.usage
    # The slow reader got several tokens per event once it fell behind (one event per read, not per token).
    assert slow.content_events < tokens * 3 // 4, (slow.content_events, tokens)
