"""Migration on the real stack: three engine processes (stories260K) behind the real gateway process,
loaded with concurrent chat, completions, responses and messages requests (greedy, seeded n=2 with
logprobs, stop strings, penalties, a JSON schema; streamed and not; the openai and anthropic SDKs). An
engine SIGKILLed, or drained with SIGTERM, or two engines killed one after the other, fail no request:
every output equals the same request's output on the unbroken fleet (text byte for byte, logprobs within
1e-4, finish reasons and usage equal), and the surviving engines hold no KV block afterwards. With every
engine dead, streams end with error events and nothing hangs."""

from __future__ import annotations

import asyncio
import math
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.engine_fleet import EngineFleet
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.polling import wait_for
from tests.support.processes import require_shared, start_gateway
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

ADMIN_KEY = "admin-secret"
REQUESTS = 160  # each scenario's load, all at once; with n=2 for an eighth of them
# Eight sequences per batch: each engine runs some of its requests and queues the rest.
ENGINE_ARGS = ("--max-num-seqs", "8", "--drain-seconds", "1")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@dataclass(frozen=True)
class Spec:
    """One request of the load: its endpoint, whether it streams, and its body."""

    endpoint: str  # "chat" | "completions"
    stream: bool
    body: dict[str, Any]


def load(count: int) -> list[Spec]:
    """`count` requests mixing every kind of choice a migration must continue exactly."""
    specs = []
    for i in range(count):
        kind = i % 8
        stream = i % 5 != 4  # a fifth are not streamed
        prompt = f"Once upon a time, number {i}"
        if kind == 0:  # greedy to the length limit
            body = {"prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
            specs.append(Spec("completions", stream, body))
        elif kind == 1:  # seeded, two choices, logprobs
            body = {"prompt": prompt, "max_tokens": 120, "temperature": 0.9, "seed": i, "n": 2, "logprobs": 2}
            specs.append(Spec("completions", stream, body | {"ignore_eos": True}))
        elif kind == 2:  # a stop string, held back while it may still match
            body = {"prompt": prompt, "max_tokens": 160, "temperature": 0, "stop": ["the park", "big tree"]}
            specs.append(Spec("completions", stream, body))
        elif kind == 3:  # penalties, seeded, with logprobs
            body = {
                "messages": MESSAGES,
                "max_tokens": 140,
                "temperature": 0.7,
                "seed": i,
                "presence_penalty": 0.8,
                "frequency_penalty": 0.5,
                "logprobs": True,
                "top_logprobs": 2,
            }
            specs.append(Spec("chat", stream, body | {"repetition_penalty": 1.2, "ignore_eos": True}))
        elif kind == 4:  # a JSON schema, seeded
            schema = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            }
            body = {
                "messages": MESSAGES,
                "max_tokens": 120,
                "temperature": 0.8,
                "seed": i,
                "response_format": schema,
            }
            specs.append(Spec("chat", stream, body))
        elif kind == 5:  # greedy chat with logprobs
            body = {
                "messages": MESSAGES,
                "max_tokens": 150,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 1,
            }
            specs.append(Spec("chat", stream, body | {"ignore_eos": True}))
        elif kind == 6:  # the Responses API, seeded
            body = {
                "input": prompt,
                "max_output_tokens": 150,
                "temperature": 0.8,
                "seed": i,
                "ignore_eos": True,
            }
            specs.append(Spec("responses", stream, body))
        else:  # Anthropic's Messages API, greedy
            body = {"messages": MESSAGES, "max_tokens": 150, "temperature": 0}
            specs.append(Spec("messages", stream, body))
    return specs


@dataclass
class Outcome:
    """What a client got: per choice its text, finish reason and (token, logprob) pairs; the usage."""

    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    logprobs: dict[int, list[tuple[str, float]]] = field(default_factory=dict)
    usage: tuple[int, int] | None = None
    error: str | None = None  # the error's code (OpenAI, Responses) or type (Anthropic)
    chunks: int = 0


def _logprob_pairs(choice: Any, endpoint: str) -> list[tuple[str, float]]:
    if choice.logprobs is None:
        return []
    if endpoint == "chat":
        return [(entry.token, entry.logprob) for entry in choice.logprobs.content or ()]
    return list(zip(choice.logprobs.tokens or (), choice.logprobs.token_logprobs or (), strict=True))


async def run_responses(client: openai.AsyncOpenAI, spec: Spec, outcome: Outcome) -> None:
    body = dict(spec.body)
    extra = {key: body.pop(key) for key in ("seed", "ignore_eos") if key in body}
    try:
        if not spec.stream:
            response = await client.responses.create(model=MODEL, extra_body=extra, **body)
        else:
            stream = await client.responses.create(model=MODEL, stream=True, extra_body=extra, **body)
            response = None
            async for event in stream:
                outcome.chunks += 1
                if event.type in ("response.completed", "response.incomplete"):
                    response = event.response
                elif event.type == "response.failed":
                    assert event.response.error is not None
                    outcome.error = event.response.error.code
                    return
            assert response is not None
        outcome.texts[0] = response.output_text
        outcome.finish[0] = response.status
        outcome.usage = (response.usage.input_tokens, response.usage.output_tokens)
    except openai.APIError as exc:
        outcome.error = _code(exc)


def _code(exc: openai.APIError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    return f"{body.get('type')}/{body.get('code')}"


def _prompt_tokens(usage: Any) -> int:
    """The whole prompt: Anthropic's input_tokens leaves out what the prefix cache held."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


async def run_messages(client: anthropic.AsyncAnthropic, spec: Spec, outcome: Outcome) -> None:
    body = dict(spec.body)
    extra = {"temperature": body.pop("temperature")}
    try:
        if not spec.stream:
            message = await client.messages.create(model=MODEL, extra_body=extra, **body)
            outcome.texts[0] = "".join(block.text for block in message.content if block.type == "text")
            outcome.finish[0] = message.stop_reason
            outcome.usage = (_prompt_tokens(message.usage), message.usage.output_tokens)
            return
        stream = await client.messages.create(model=MODEL, stream=True, extra_body=extra, **body)
        prompt_tokens = 0
        async for event in stream:
            outcome.chunks += 1
            if event.type == "message_start":
                prompt_tokens = _prompt_tokens(event.message.usage)
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                outcome.texts[0] = outcome.texts.get(0, "") + event.delta.text
            elif event.type == "message_delta":
                outcome.finish[0] = event.delta.stop_reason
                outcome.usage = (prompt_tokens, event.usage.output_tokens)
    except anthropic.APIError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        outcome.error = f"anthropic/{body.get('error', {}).get('type')}"


async def run(client: openai.AsyncOpenAI, spec: Spec, outcome: Outcome) -> None:
    body = dict(spec.body)
    extra = {key: body.pop(key) for key in ("ignore_eos", "repetition_penalty") if key in body}
    create = client.chat.completions.create if spec.endpoint == "chat" else client.completions.create
    try:
        if not spec.stream:
            response = await create(model=MODEL, extra_body=extra, **body)
            for choice in response.choices:
                text = choice.message.content if spec.endpoint == "chat" else choice.text
                outcome.texts[choice.index] = text or ""
                outcome.finish[choice.index] = choice.finish_reason
                outcome.logprobs[choice.index] = _logprob_pairs(choice, spec.endpoint)
            outcome.usage = (response.usage.prompt_tokens, response.usage.completion_tokens)
            return
        stream = await create(
            model=MODEL, stream=True, stream_options={"include_usage": True}, extra_body=extra, **body
        )
        async for chunk in stream:
            outcome.chunks += 1
            for choice in chunk.choices:
                text = choice.delta.content if spec.endpoint == "chat" else choice.text
                outcome.texts[choice.index] = outcome.texts.get(choice.index, "") + (text or "")
                outcome.logprobs.setdefault(choice.index, []).extend(_logprob_pairs(choice, spec.endpoint))
                if choice.finish_reason is not None:
                    outcome.finish[choice.index] = choice.finish_reason
            if chunk.usage is not None:
                outcome.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    except openai.APIError as exc:
        outcome.error = _code(exc)


class Load:
    """The load running in a thread of its own (its own event loop), so the test can act meanwhile."""

    def __init__(self, url: str, specs: list[Spec]) -> None:
        self.specs = specs
        self.outcomes = [Outcome() for _ in specs]
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(url)), daemon=True)

    async def _run(self, url: str) -> None:
        limits = httpx.Limits(max_connections=len(self.specs) + 8)
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key="unused",
            max_retries=0,
            timeout=300,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
        ) as client:
            async with anthropic.AsyncAnthropic(
                base_url=url,
                api_key="unused",
                max_retries=0,
                timeout=300,
                http_client=anthropic.DefaultAsyncHttpxClient(limits=limits),
            ) as claude:
                await asyncio.gather(
                    *(
                        run_messages(claude, spec, outcome)
                        if spec.endpoint == "messages"
                        else run_responses(client, spec, outcome)
                        if spec.endpoint == "responses"
                        else run(client, spec, outcome)
                        for spec, outcome in zip(self.specs, self.outcomes, strict=True)
                    )
                )

    def start(self) -> Load:
        self._thread.start()
        return self

    def streamed_chunks(self) -> int:
        return sum(outcome.chunks for outcome in self.outcomes)

    def join(self) -> list[Outcome]:
        self._thread.join(timeout=600)
        assert not self._thread.is_alive(), "the load hung"
        return self.outcomes


def _nodes(url: str) -> dict[str, dict]:
    response = httpx.get(f"{url}/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert response.status_code == 200, response.text
    return {node["address"]: node for node in response.json()["nodes"]}


def _migrations(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("conduit_gateway_migrations_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('reason="')[1].split('"')[0]] = float(value)
    return counts


@pytest.fixture(scope="module")
def fleet():
    model = require_shared(f"models/{MODEL}")
    with EngineFleet(model, 3, ENGINE_ARGS) as engines:
        yield engines


@pytest.fixture(scope="module")
def otlp():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def gateway(fleet, otlp):
    # --retries 2: a request still queued (no output yet) survives two engine deaths by retries alone.
    args = (
        "--routing",
        "round_robin",
        "--admin-key",
        ADMIN_KEY,
        "--health-interval",
        "0.5",
        "--retries",
        "2",
    )
    # Traced: each migration is an event on its request's span (exported every 50 ms).
    tracing = ("--otlp-endpoint", otlp.endpoint)
    with start_gateway(fleet.addresses, *args, *tracing, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as process:
        yield process


@pytest.fixture(scope="module")
def reference(fleet, gateway) -> list[Outcome]:
    """The load's outputs on the unbroken fleet (greedy and seeded choices do not depend on the batch)."""
    outcomes = Load(gateway.url, load(REQUESTS)).start().join()
    assert [o.error for o in outcomes] == [None] * REQUESTS
    return outcomes


def _restore(fleet: EngineFleet, gateway_url: str) -> None:
    """Restart the engines that are dead and wait until the gateway has every engine in rotation."""
    for index, engine in enumerate(fleet.engines):
        if engine.process.poll() is not None:
            fleet.restart(index)
    wait_for(
        lambda: all(node["state"] == "serving" for node in _nodes(gateway_url).values()),
        "every engine back in rotation",
        attempts=2400,
    )


@pytest.fixture
def whole_fleet(fleet, gateway):
    """Every engine back and serving before each scenario: those the last one killed restart here, so
    the module's last scenario leaves its dead engines to the fleet's teardown (no restart nobody uses)."""
    _restore(fleet, gateway.url)
    return fleet


def _assert_equal_outputs(outcomes: list[Outcome], reference: list[Outcome]) -> None:
    for index, (got, want) in enumerate(zip(outcomes, reference, strict=True)):
        assert got.error is None, f"request {index} failed: {got.error}"
        assert got.texts == want.texts, f"request {index}"
        assert got.finish == want.finish, f"request {index}"
        assert got.usage == want.usage, f"request {index}"
        assert got.logprobs.keys() == want.logprobs.keys(), f"request {index}"
        for choice, pairs in want.logprobs.items():
            assert [token for token, _ in got.logprobs[choice]] == [token for token, _ in pairs], (
                f"request {index}"
            )
            for (_, a), (_, b) in zip(got.logprobs[choice], pairs, strict=True):
                assert math.isclose(a, b, abs_tol=1e-4), f"request {index}: logprob {a} != {b}"


def _assert_no_blocks_held(fleet: EngineFleet, alive: list[int]) -> None:
    for index in alive:
        wait_for(
            lambda index=index: fleet.load(index).kv_blocks_used == 0, f"engine {index} frees its blocks"
        )


def _wait_until_streaming(load_: Load, gateway_url: str, victim: str) -> None:
    """Until the load is well under way and the victim is running some of it."""
    wait_for(lambda: load_.streamed_chunks() >= REQUESTS, "the streams under way", attempts=4000)
    assert _nodes(gateway_url)[victim]["in_flight"] > 0


def test_sigkill_of_an_engine_under_load_fails_no_request(whole_fleet, gateway, reference, otlp):
    before = _migrations(gateway.url).get("unavailable", 0)
    running = Load(gateway.url, load(REQUESTS)).start()
    _wait_until_streaming(running, gateway.url, whole_fleet.addresses[0])
    whole_fleet.kill(0)
    _assert_equal_outputs(running.join(), reference)
    moved = _migrations(gateway.url).get("unavailable", 0) - before
    assert moved > 0  # streams did move mid-way
    _assert_no_blocks_held(whole_fleet, [1, 2])

    # Each move is an event on its request's span: from the victim, to an engine left.
    def events() -> list[dict]:
        found = []
        for received in otlp.spans():
            for event in received.span.events:
                if event.name == "migration":
                    found.append({a.key: a.value.string_value or a.value.int_value for a in event.attributes})
        return found

    wait_for(lambda: len(events()) >= moved, "the migration span events", attempts=400)
    victim, survivors = whole_fleet.addresses[0], set(whole_fleet.addresses[1:])
    kill_events = [e for e in events() if e["conduit.migration.source"] == victim]
    assert len(kill_events) == moved
    assert all(e["conduit.migration.reason"] == "unavailable" for e in kill_events)
    assert all(e["conduit.migration.target"] in survivors for e in kill_events)


def test_sigterm_drain_of_an_engine_under_load_fails_no_request(whole_fleet, gateway, reference):
    before = _migrations(gateway.url).get("drain", 0)
    running = Load(gateway.url, load(REQUESTS)).start()
    _wait_until_streaming(running, gateway.url, whole_fleet.addresses[1])
    whole_fleet.engines[1].process.send_signal(signal.SIGTERM)  # --drain-seconds 1, then hand back
    _assert_equal_outputs(running.join(), reference)
    assert _migrations(gateway.url).get("drain", 0) > before
    assert whole_fleet.engines[1].process.wait(timeout=60) == 0
    _assert_no_blocks_held(whole_fleet, [0, 2])


def test_two_engines_killed_one_after_the_other_fail_no_request(whole_fleet, gateway, reference):
    before = sum(_migrations(gateway.url).values())
    running = Load(gateway.url, load(REQUESTS)).start()
    _wait_until_streaming(running, gateway.url, whole_fleet.addresses[2])
    whole_fleet.kill(2)
    chunks = running.streamed_chunks()
    wait_for(lambda: running.streamed_chunks() >= chunks + REQUESTS, "the load going on", attempts=4000)
    whole_fleet.kill(0)
    _assert_equal_outputs(running.join(), reference)
    assert sum(_migrations(gateway.url).values()) > before
    _assert_no_blocks_held(whole_fleet, [1])


def test_with_every_engine_dead_streams_end_with_error_events(whole_fleet, gateway):
    specs = [spec for spec in load(16) if spec.stream]
    for _ in range(3):
        running = Load(gateway.url, specs).start()
        wait_for(lambda r=running: r.streamed_chunks() >= len(specs), "the streams under way", attempts=4000)
        # Stopped at once (SIGSTOP), then killed: on a loaded machine the streams could otherwise finish
        # between this poll and the kills.
        for index in range(3):
            whole_fleet.pause(index)
        for index in range(3):
            whole_fleet.kill(index)
        outcomes = running.join()  # nothing hangs: each stream ends
        if any(outcome.error is not None for outcome in outcomes):
            break
        # Every stream had finished before the engines stopped (this poll came late): again.
        _restore(whole_fleet, gateway.url)
    # Each API's error for an engine gone mid-stream, as without migration.
    expected = {
        "completions": "server_error/engine_unavailable",
        "chat": "server_error/engine_unavailable",
        "responses": "engine_unavailable",
        "messages": "anthropic/overloaded_error",
    }
    cut = [
        (spec, outcome) for spec, outcome in zip(specs, outcomes, strict=True) if outcome.error is not None
    ]
    assert cut, "some stream was still running when the fleet died"
    for spec, outcome in cut:
        if spec.endpoint == "responses" and outcome.chunks == 0:
            # Refused before its stream began: the HTTP error, not a response.failed event.
            assert outcome.error == "server_error/engine_unavailable", spec
        else:
            assert outcome.error == expected[spec.endpoint], spec
    for outcome in outcomes:
        if outcome.error is None:  # it had finished before the kill
            assert outcome.finish and None not in outcome.finish.values()
