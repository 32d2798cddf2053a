"""A client that reads slower than its tokens arrive gets them merged into fewer events, and nothing else
changes: under load (many fast streams beside it), a deliberately slow reader with a small receive buffer
gets exactly the text, the per-token logprob entries, the finish and the usage that a fast reader gets, in
order, each once. Chat and completions (one choice, n > 1, prompt lists: choices never merged with each
other), the Responses API (read by the official openai SDK: sequence numbers stay contiguous) and the
Messages API (read by the official anthropic SDK: blocks open and close as for a fast reader). Runs the
gateway as its real process (the coalescing needs its HTTP protocol's body writer), against the
in-process fake engine, whose generations travel on one GenerateStream as a real engine's do (the shapes
test also over Generate calls)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.fake_engine import FakeEngine, Script
from tests.support.processes import start_gateway

pytestmark = pytest.mark.integration

MODEL = "fake-model"
FAST_STREAMS = 12
# Distinct words, a count prime to the token count's divisors: a dropped, repeated or moved token shows.
WORDS = tuple(f" w{i}:" + "x" * 40 for i in range(101))
MAX_TOKENS = 1500
# A small receive buffer, so that the gateway's writes back up while the slow reader waits.
SMALL_RCVBUF = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]


TRANSPORTS = ("generate", "generate_stream")


@pytest.fixture(scope="module")
def stacks():
    """A gateway on a fake engine per transport: its generations as Generate calls, or on one
    GenerateStream (what a real engine gets)."""
    with ExitStack() as started:
        gateways, fakes = {}, {}
        for transport in TRANSPORTS:
            fake = fakes[transport] = started.enter_context(FakeEngine(MODEL))
            fake.reset(Script(words=WORDS, max_tokens_cap=MAX_TOKENS))
            fake.generate_stream = "on" if transport == "generate_stream" else "off"
            gateways[transport] = started.enter_context(start_gateway(fake.address, "--log-level", "warning"))
        yield gateways
        for transport, fake in fakes.items():
            methods = {method.rsplit("/", 1)[-1] for method, _ in fake.record.calls}
            assert ("GenerateStream" in methods) == (transport == "generate_stream"), methods


@pytest.fixture
def stack(stacks):
    """The gateway of a real engine's path (GenerateStream); the shapes test runs over both."""
    return stacks["generate_stream"]


def expected_text(tokens: int, choice: int = 0) -> str:
    """The fake engine's text for the `choice`-th choice of a prompt (its words start `choice` later)."""
    return "".join(WORDS[(step + choice) % len(WORDS)] for step in range(tokens))


# -- readers -----------------------------------------------------------------------------------------


def fast_events(url: str, path: str, body: dict) -> list[tuple[str | None, str]]:
    """(event name, data) of every SSE event, read as fast as they come."""
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            return sse_events(response.read().decode("utf-8"))


def slow_events(url: str, path: str, body: dict, start: threading.Event) -> list[tuple[str | None, str]]:
    """A raw socket with a 4 KiB receive buffer that waits until `start` is set (and half a second),
    then reads 8 KiB every 2 ms or so."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    raw = bytearray()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        for option in SMALL_RCVBUF:
            sock.setsockopt(*option)
        sock.settimeout(120)
        sock.connect((host, int(port)))
        sock.sendall(head.encode() + payload)
        start.wait(120)
        time.sleep(0.5)
        while data := sock.recv(8192):
            raw += data
            time.sleep(0.002)
    status, _, chunked = bytes(raw).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200"), status
    return sse_events(_unchunk(chunked).decode("utf-8"))


def sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            events.append((name, data))
    return events


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


class SlowLink:
    """A TCP relay in front of the gateway for an SDK client: it reads the gateway's answers through a
    socket with a 4 KiB receive buffer, reads nothing until `start` is set (and half a second), then
    passes on `chunk` bytes every 2 ms or so. (An SDK's HTTP client sets socket
    options only once connected, too late to shrink the window it announced.)"""

    def __init__(self, url: str, start: threading.Event, chunk: int = 8192) -> None:
        self._chunk = chunk
        self._start = start
        host, port = url.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            for option in SMALL_RCVBUF:
                upstream.setsockopt(*option)
            upstream.connect(self._upstream)
            threading.Thread(target=self._relay, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, self._chunk), daemon=True).start()

    def _relay(self, source: socket.socket, target: socket.socket, chunk: int | None) -> None:
        slowly = chunk is not None
        try:
            if slowly:
                self._start.wait(120)
                time.sleep(0.5)
            while data := source.recv(chunk or 65536):
                target.sendall(data)
                if slowly:
                    time.sleep(0.002)
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()


def read_slowly(events) -> list:
    """An SDK's stream, read 2 ms an event (behind a SlowLink)."""
    out = []
    for event in events:
        out.append(event)
        time.sleep(0.002)
    return out


def run_side_by_side(
    slow: Callable[[threading.Event], Any], fast: Callable[[], Any]
) -> tuple[Any, list[Any]]:
    """The slow reader with FAST_STREAMS fast ones beside it: (its result, theirs). The slow reader is
    given an event set once the fast ones have all finished, to start reading then: by that time the
    engine has generated its tokens, or the gateway stopped reading them as it waits for the client,
    either way far more than one event's worth are pending (whatever the machine's load)."""
    fast_done = threading.Event()
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str, reader: Callable[[], Any]) -> None:
        try:
            results[name] = reader()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    slow_thread = threading.Thread(target=run, args=("slow", lambda: slow(fast_done)))
    threads = [threading.Thread(target=run, args=(f"fast{i}", fast)) for i in range(FAST_STREAMS)]
    for thread in [slow_thread, *threads]:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    fast_done.set()
    slow_thread.join(timeout=300)
    if errors:
        raise errors[0]
    return results.pop("slow"), list(results.values())


# -- chat and completions ----------------------------------------------------------------------------


class ChoiceText:
    def __init__(self) -> None:
        self.text = ""
        self.logprobs: list = []  # one entry per token (chat: the content entries; completions: tuples)
        self.finishes: list[str] = []


class Collected:
    """What a reader made of one chat or completions stream's events, per choice index."""

    def __init__(self, api: str, events: list[tuple[str | None, str]]) -> None:
        self.api = api
        self.choices: dict[int, ChoiceText] = {}
        self.usage: dict | None = None
        self.content_events = 0  # choice entries that carried text
        self.done = 0
        for _, data in events:
            self.add(data)

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
        indexes = [choice["index"] for choice in event["choices"]]
        assert len(indexes) == len(set(indexes)), f"one choice twice in an event: {indexes}"
        for choice in event["choices"]:
            state = self.choices.setdefault(choice["index"], ChoiceText())
            assert not state.finishes, "a choice went on after its finish"
            text = choice["delta"].get("content", "") if self.api == "chat" else choice["text"]
            if text:
                self.content_events += 1
                state.text += text
            logprobs = choice["logprobs"]
            if logprobs and self.api == "chat":
                state.logprobs += logprobs["content"]
            elif logprobs:
                state.logprobs += zip(
                    logprobs["tokens"],
                    logprobs["token_logprobs"],
                    logprobs["top_logprobs"],
                    logprobs["text_offset"],
                    strict=True,
                )
            if choice["finish_reason"] is not None:
                state.finishes.append(choice["finish_reason"])


# (api, n, prompts (completions: a list of this many), tokens per choice)
SHAPES = {
    "chat": ("chat", 1, 1, MAX_TOKENS),
    "completions": ("completions", 1, 1, MAX_TOKENS),
    "chat-n3": ("chat", 3, 1, 500),
    "completions-n2-prompts2": ("completions", 2, 2, 400),
}


def _body(api: str, n: int, prompts: int, tokens: int) -> dict:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if n > 1:
        body["n"] = n
    if api == "chat":
        return {**body, "messages": [{"role": "user", "content": "go"}], "logprobs": True, "top_logprobs": 2}
    prompt = "go" if prompts == 1 else ["go" + " on" * i for i in range(prompts)]
    return {**body, "prompt": prompt, "logprobs": 5}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_slow_reader_gets_merged_events_with_the_same_tokens_logprobs_and_usage_as_a_fast_one(
    stacks, transport, shape
):
    stack = stacks[transport]
    api, n, prompts, tokens = SHAPES[shape]
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    body = _body(api, n, prompts, tokens)
    slow, fast = run_side_by_side(
        lambda start: Collected(api, slow_events(stack.url, path, body, start)),
        lambda: Collected(api, fast_events(stack.url, path, body)),
    )
    for collected in [slow, *fast]:
        assert sorted(collected.choices) == list(range(n * prompts))
        for index, choice in collected.choices.items():
            # Choice k of a prompt list is choice k % n of its prompt: its own words, never another's.
            assert choice.text == expected_text(tokens, index % n), index
            assert len(choice.logprobs) == tokens
            assert choice.finishes == ["length"]
        assert collected.done == 1
        assert collected.usage is not None
        assert collected.usage["completion_tokens"] == tokens * n * prompts
    for index, choice in slow.choices.items():
        assert choice.logprobs == fast[0].choices[index].logprobs
    assert slow.usage == fast[0].usage
    # The slow reader got several tokens per event once it fell behind (one event per read, not per token).
    total = tokens * n * prompts
    assert slow.content_events < total * 3 // 4, (slow.content_events, total)


# -- the Responses API -------------------------------------------------------------------------------

_RESPONSE_DELTAS = {
    "response.output_text.delta",
    "response.reasoning_text.delta",
    "response.function_call_arguments.delta",
}


def _response_body() -> dict:
    return {
        "model": MODEL,
        "input": "go",
        "max_output_tokens": MAX_TOKENS,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }


def _response_check(events: list[dict]) -> tuple[list[tuple], dict]:
    """Check one Responses stream; (its logprob entries, its usage)."""
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert "".join(event["delta"] for event in deltas) == expected_text(MAX_TOKENS)
    (done,) = [event for event in events if event["type"] == "response.output_text.done"]
    assert done["text"] == expected_text(MAX_TOKENS)
    logprobs = [
        (entry["token"], entry["logprob"], [(top["token"], top["logprob"]) for top in entry["top_logprobs"]])
        for event in deltas
        for entry in event["logprobs"]
    ]
    assert len(logprobs) == MAX_TOKENS
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output_text"] == expected_text(MAX_TOKENS)
    return logprobs, events[-1]["response"]["usage"]


def _collapsed(types: list[str], deltas: set[str]) -> list[str]:
    """Event types with each run of one delta type as one: the order a merged stream must keep."""
    out: list[str] = []
    for kind in types:
        if not (out and kind in deltas and out[-1] == kind):
            out.append(kind)
    return out


def test_a_slow_openai_sdk_reader_of_a_response_gets_merged_text_deltas_in_contiguous_sequence(stack):
    def slow(fast_done: threading.Event) -> list[dict]:
        link = SlowLink(stack.url, fast_done)
        try:
            with openai.OpenAI(base_url=f"{link.url}/v1", api_key="unused", max_retries=0) as client:
                stream = client.responses.create(**_response_body(), stream=True)
                return [event.model_dump(exclude_none=True) for event in read_slowly(stream)]
        finally:
            link.close()

    def fast() -> list[dict]:
        events = fast_events(stack.url, "/v1/responses", {**_response_body(), "stream": True})
        return [json.loads(data) for _, data in events]

    slow_stream, fast_streams = run_side_by_side(slow, fast)
    slow_logprobs, slow_usage = _response_check(slow_stream)
    for stream in fast_streams:
        assert _response_check(stream) == (slow_logprobs, slow_usage)
    assert slow_usage["output_tokens"] == MAX_TOKENS
    # Same events in the same order, only runs of one item's deltas shorter.
    slow_types = [event["type"] for event in slow_stream]
    fast_types = [event["type"] for event in fast_streams[0]]
    assert _collapsed(slow_types, _RESPONSE_DELTAS) == _collapsed(fast_types, _RESPONSE_DELTAS)
    merged = slow_types.count("response.output_text.delta")
    assert merged < MAX_TOKENS * 3 // 4, merged


# -- the Messages API --------------------------------------------------------------------------------

_MESSAGE_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


def _message_body() -> dict:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "go"}]}


def _message_check(events: list[dict]) -> dict:
    """Check one Messages stream (pings left out); its final usage."""
    types = [event["type"] for event in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop") == 1
    deltas = [event for event in events if event["type"] == "content_block_delta"]
    assert all(event["index"] == 0 and event["delta"]["type"] == "text_delta" for event in deltas)
    assert "".join(event["delta"]["text"] for event in deltas) == expected_text(MAX_TOKENS)
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    return events[-2]["usage"]


def test_a_slow_anthropic_sdk_reader_gets_merged_text_deltas_and_the_same_message(stack):
    def slow(fast_done: threading.Event) -> tuple[list[dict], Any]:
        link = SlowLink(stack.url, fast_done, chunk=512)  # Anthropic's events are small (no logprobs)
        try:
            with anthropic.Anthropic(base_url=link.url, api_key="unused", max_retries=0) as client:
                with client.messages.stream(**_message_body()) as stream:
                    events = [
                        event.model_dump() for event in read_slowly(stream) if event.type in _MESSAGE_EVENTS
                    ]
                    return events, stream.get_final_message()
        finally:
            link.close()

    def fast() -> list[dict]:
        events = fast_events(stack.url, "/v1/messages", {**_message_body(), "stream": True})
        return [json.loads(data) for name, data in events if name in _MESSAGE_EVENTS]

    (slow_stream, message), fast_streams = run_side_by_side(slow, fast)
    usage = _message_check(slow_stream)
    for stream in fast_streams:
        fast_usage = _message_check(stream)
        assert fast_usage == {key: usage[key] for key in fast_usage}
    assert usage["output_tokens"] == MAX_TOKENS
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected_text(MAX_TOKENS)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == MAX_TOKENS
    slow_types = [event["type"] for event in slow_stream]
    fast_types = [event["type"] for event in fast_streams[0]]
    assert _collapsed(slow_types, {"content_block_delta"}) == _collapsed(fast_types, {"content_block_delta"})
    merged = slow_types.count("content_block_delta")
    assert merged < MAX_TOKENS * 3 // 4, merged


# Reasoning up to the first `</think>` (deepseek_r1: the template opened the tag), the answer after it.
THINKING_WORDS = (*WORDS[:100], "</think>")


@pytest.fixture(scope="module")
def thinking_stack():
    with FakeEngine(MODEL) as fake:
        fake.reset(Script(words=THINKING_WORDS, max_tokens_cap=MAX_TOKENS))
        with start_gateway(
            fake.address, "--log-level", "warning", "--reasoning-parser", "deepseek_r1"
        ) as gateway:
            yield gateway


def _blocks(events: list[tuple[str | None, str]]) -> tuple[list[str], dict[str, str], dict]:
    """A Messages stream's event names (pings left out), each block type's streamed text, its usage."""
    names, texts, usage = [], {"thinking": "", "text": ""}, {}
    for name, data in events:
        if name not in _MESSAGE_EVENTS:
            continue
        names.append(name)
        event = json.loads(data)
        delta = event.get("delta", {})
        if name == "content_block_delta" and delta["type"] == "thinking_delta":
            texts["thinking"] += delta["thinking"]
        elif name == "content_block_delta" and delta["type"] == "text_delta":
            texts["text"] += delta["text"]
        elif name == "message_delta":
            usage = event["usage"]
    return names, texts, usage


def test_a_slow_reader_of_a_thinking_message_gets_one_delta_per_block_and_read_and_the_same_blocks(
    thinking_stack,
):
    body = {**_message_body(), "stream": True, "thinking": {"type": "adaptive"}}
    slow, fast = run_side_by_side(
        lambda start: _blocks(slow_events(thinking_stack.url, "/v1/messages", body, start)),
        lambda: _blocks(fast_events(thinking_stack.url, "/v1/messages", body)),
    )
    names, texts, usage = slow
    assert texts["thinking"] == "".join(WORDS[:100])
    assert len(texts["text"]) > 0
    for fast_names, fast_texts, fast_usage in fast:
        assert (fast_texts, fast_usage) == (texts, usage)
        assert _collapsed(names, {"content_block_delta"}) == _collapsed(fast_names, {"content_block_delta"})
    assert _collapsed(names, {"content_block_delta"}).count("content_block_start") == 2
    assert usage["output_tokens"] == MAX_TOKENS
    merged = names.count("content_block_delta")
    assert merged < MAX_TOKENS * 3 // 4, merged
