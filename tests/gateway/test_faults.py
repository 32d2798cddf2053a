"""Fault injection with the fake engine: errors before and after the first token, an unavailable engine,
a slow engine, and clients that go away."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from conduit.engine.v1 import engine_pb2
from tests.gateway.conftest import MODEL
from tests.gateway.sse import parse_events, post_stream
from tests.support.fake_engine import FakeEngine
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.processes import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["generate", "generate_stream"])
def fake_engine_server(request):
    """The fake engine, its generations reaching it as Generate calls or on one GenerateStream: every
    fault here must look the same to the client either way."""
    with FakeEngine(MODEL) as fake:
        fake.generate_stream = "on" if request.param == "generate_stream" else "off"
        yield fake


# What a client sees of any engine failure: the engine's own words (internals) stay in the gateway's log.
GENERIC_500 = "The engine failed to process the request."
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ],
)
def test_error_before_first_token_sets_http_status(http, fake, code, status):
    fake.script.error_before = code
    fake.script.error_message = "boom"
    for stream in (False, True):
        response = http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == status
        # A 500 never carries what the engine said about its own failure (it may be internals).
        expected = GENERIC_500 if status == 500 else "boom"
        assert response.json()["error"]["message"] == expected


def test_error_after_first_token_ends_stream_with_error_event_and_done(http, fake):
    fake.script.error_after = 2
    fake.script.error_message = "device lost"
    response, events = post_stream(http, "/v1/chat/completions", {**CHAT, "max_tokens": 8, "stream": True})
    assert response.status_code == 200
    *chunks, error, done = events
    assert done == "[DONE]"
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "Once", " upon"]
    assert error == {
        "error": {
            "message": GENERIC_500,
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
    }


def test_sdk_raises_on_mid_stream_error(client, fake):
    fake.script.error_after = 1
    fake.script.error_message = "device lost"
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in client.chat.completions.create(**CHAT, max_tokens=8, stream=True):
            received.append(chunk.choices[0].delta.content)
    assert received == ["", "Once"]
    assert caught.value.message == GENERIC_500


def test_error_after_first_token_without_stream_is_an_error_response(http, fake):
    fake.script.error_after = 2
    fake.script.error_code = grpc.StatusCode.INTERNAL
    fake.script.error_message = "device lost"
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == GENERIC_500


def test_engine_finish_reason_error_is_reported(http, fake):
    fake.script.finish_reason = engine_pb2.FINISH_REASON_ERROR
    _, events = post_stream(
        http, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
    )
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"


def test_stream_without_any_message_is_502(http, fake):
    fake.script.default_max_tokens = 0
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "engine_error"


def test_one_failing_prompt_cancels_the_others(http, fake):
    fake.script.error_after = 3  # every engine call fails after its third message
    fake.script.error_message = "device lost"
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 8})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == GENERIC_500


def test_unreachable_engine_is_skipped(make_gateway, fake):
    dead = f"127.0.0.1:{free_port()}"
    gateway = make_gateway([dead, fake.address])
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as sdk:
        texts = [
            sdk.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text for _ in range(4)
        ]
    assert texts == ["Once"] * 4
    health = httpx.get(f"{gateway.url}/health").json()
    assert [e["serving"] for e in health["engines"]] == [False, True]


def test_unavailable_engine_is_retried_on_another(make_gateway, fake):
    with FakeEngine(MODEL) as draining:
        draining.script.error_before = grpc.StatusCode.UNAVAILABLE
        draining.script.error_message = "draining"
        gateway = make_gateway([draining.address, fake.address])
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as sdk:
            for _ in range(3):
                assert sdk.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == "Once"
        assert len(fake.record.requests) == 3


def test_round_robin_over_engines(make_gateway, fake):
    with FakeEngine(MODEL) as second:
        gateway = make_gateway([fake.address, second.address])
        for _ in range(4):
            httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert (len(fake.record.requests), len(second.record.requests)) == (2, 2)


def test_models_of_several_engines_are_listed_and_routed(make_gateway, fake):
    with FakeEngine("other-model") as other:
        gateway = make_gateway([fake.address, other.address])
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as sdk:
            assert sorted(m.id for m in sdk.models.list().data) == [MODEL, "other-model"]
            for _ in range(2):
                sdk.completions.create(model="other-model", prompt="x", max_tokens=1)
        assert len(other.record.requests) == 2 and not fake.record.requests


def test_slow_engine_client_disconnect_cancels_the_engine_stream(gateway, fake):
    fake.script.hold_after = 1
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as raw,
        raw.stream("POST", "/v1/completions", json=body) as r,
    ):
        first = next(line for line in r.iter_lines() if line)
        assert parse_events(first + "\n\n")[0]["choices"][0]["text"] == "Once"
    # The response is closed while the engine is stalled: the gateway must cancel the gRPC call.
    wait_for(lambda: fake.record.cancelled == 1, "the engine to see the cancellation")
    assert fake.record.completed == 0
    wait_for(lambda: gateway.ctx.limiter.active == 0, "the gateway to release the request")


def test_slow_first_token_client_disconnect_cancels(gateway, fake):
    """Disconnecting while the gateway still waits for the first token (no response started yet)."""
    fake.script.hold_after = 0
    for stream in (True, False):
        fake.record.cancelled = 0
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{gateway.url}/v1/completions",
                json={"model": MODEL, "prompt": "x", "stream": stream},
                timeout=httpx.Timeout(30, read=0.5),
            )
        wait_for(lambda: fake.record.cancelled == 1, "the engine to see the cancellation")
    wait_for(lambda: gateway.ctx.limiter.active == 0, "the gateway to release the requests")


def test_slow_engine_request_timeout_is_504(make_gateway, fake):
    gateway = make_gateway([fake.address], request_timeout_s=0.3)
    fake.script.hold_after = 0
    response = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"


def test_an_engine_that_claims_generate_stream_but_refuses_it_is_served_one_call_per_prompt(fake):
    """GetModelInfo says generate_stream, the RPC answers UNIMPLEMENTED (say, a proxy that passes only
    the methods it knows): the request opened on it is retried, the node stops multiplexing for good."""
    mode = fake.generate_stream
    fake.generate_stream = "claimed"
    try:
        with GatewayThread([fake.address]) as gateway:
            node = gateway.ctx.pool.engines[0]
            wait_for(lambda: node.serving, "the node in rotation")
            assert node.client.multiplexed
            first = httpx.post(
                f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30
            )
            assert first.status_code == 503  # its only engine refused it (UNAVAILABLE): nowhere to retry
            assert not node.client.multiplexed
            wait_for(lambda: node.serving, "the node back in rotation")
            assert not node.client.multiplexed  # back in rotation, it stays on Generate
            second = httpx.post(
                f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30
            )
            assert second.status_code == 200
            assert fake.record.requests  # served by Generate
    finally:
        fake.generate_stream = mode
