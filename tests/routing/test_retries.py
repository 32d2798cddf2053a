"""Retries and health with fault-injecting fake engines: a refusal before the first token moves to another
engine once, never after the first token; health changes eject and re-admit nodes at once."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from tests.gateway.sse import post_stream
from tests.routing.helpers import admin, nodes
from tests.support.fake_engine import FakeEngine
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration

MODEL = "fake-model"
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 2}


@pytest.fixture
def fakes():
    engines = [FakeEngine(MODEL).start() for _ in range(3)]
    yield engines
    for engine in engines:
        engine.stop()


def _requests(fakes) -> list[int]:
    return [len(fake.record.requests) for fake in fakes]


def test_refusal_before_the_first_token_is_retried_on_another_engine(fakes, make_gateway):
    gateway = make_gateway([fake.address for fake in fakes])
    fakes[0].script.error_before = grpc.StatusCode.RESOURCE_EXHAUSTED
    fakes[0].script.error_message = "waiting queue is full"
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as client:
        texts = [client.completions.create(**BODY).choices[0].text for _ in range(3)]
    assert texts == ["Once upon"] * 3
    # Every request engine 0 refused went on to another engine, which served it.
    refused, *served = _requests(fakes)
    assert refused >= 1 and sum(served) == 3
    view = nodes(gateway.url)[fakes[0].address]
    assert (view["routed"], view["failures"], view["ejections"], view["state"]) == (
        refused,
        refused,
        0,
        "serving",
    )
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert f'conduit_gateway_retries_total{{code="RESOURCE_EXHAUSTED"}} {refused}.0' in metrics
    assert f'conduit_gateway_node_failures_total{{node="{fakes[0].address}"}} {refused}.0' in metrics


@pytest.mark.parametrize(
    ("code", "status"), [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503)]
)
def test_when_the_engines_tried_all_refuse_the_client_gets_their_status(fakes, make_gateway, code, status):
    gateway = make_gateway([fake.address for fake in fakes], retries=1)
    for fake in fakes:
        fake.script.error_before = code
        fake.script.error_message = "refused"
    response = httpx.post(f"{gateway.url}/v1/completions", json=BODY)
    assert response.status_code == status
    assert response.json()["error"]["message"] == "refused"
    if status == 429:
        assert response.headers["retry-after"] == "1"
    # One attempt and one retry: the third engine was never asked.
    assert sorted(_requests(fakes)) == [0, 1, 1]


def test_no_retry_when_retries_is_zero(fakes, make_gateway):
    gateway = make_gateway([fake.address for fake in fakes], retries=0)
    fakes[0].script.error_before = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert httpx.post(f"{gateway.url}/v1/completions", json=BODY).status_code == 429
    assert _requests(fakes) == [1, 0, 0]


def _stream_broken_after_one_token(fakes, gateway):
    fakes[0].script.error_after = 1
    fakes[0].script.error_code = grpc.StatusCode.UNAVAILABLE
    fakes[0].script.error_message = "engine went away"
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        return post_stream(http, "/v1/completions", {**BODY, "max_tokens": 4, "stream": True})


def test_failure_after_the_first_token_is_never_retried(fakes, make_gateway):
    # Migration off: the stream is not retried from the start, it ends with an error event.
    gateway = make_gateway([fake.address for fake in fakes], migration_limit=0)
    response, events = _stream_broken_after_one_token(fakes, gateway)
    assert response.status_code == 200
    assert [event["choices"][0]["text"] for event in events[:-2]] == ["Once"]
    assert events[-2]["error"]["code"] == "engine_unavailable" and events[-1] == "[DONE]"
    assert _requests(fakes) == [1, 0, 0]
    view = nodes(gateway.url)[fakes[0].address]
    assert (view["failures"], view["in_flight"]) == (1, 0)


def test_with_migration_a_broken_stream_continues_on_another_engine_where_it_stopped(fakes, make_gateway):
    gateway = make_gateway([fake.address for fake in fakes], routing="round_robin")
    response, events = _stream_broken_after_one_token(fakes, gateway)
    assert response.status_code == 200
    # Nothing repeated, nothing lost: the other engine was asked to continue after the one token sent.
    texts = [event["choices"][0]["text"] for event in events[:-1]]
    assert [text for text in texts if text] == ["Once", " upon", " a", " time"]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    moved = [request for fake in fakes[1:] for request in fake.record.requests]
    assert len(fakes[0].record.requests) == 1 and len(moved) == 1
    assert [list(choice.token_ids) for choice in moved[0].continuation.choices] == [[100]]
    assert nodes(gateway.url)[fakes[0].address]["in_flight"] == 0


def test_health_changes_eject_and_readmit_a_node(fakes, make_gateway):
    gateway = make_gateway([fake.address for fake in fakes[:2]])
    address = fakes[0].address
    fakes[0].set_serving(False)
    wait_for(lambda: nodes(gateway.url)[address]["state"] == "unavailable", "the watch to eject it")
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as client:
        for _ in range(4):
            client.completions.create(**BODY)
    assert _requests(fakes) == [0, 4, 0]
    fakes[0].set_serving(True)
    wait_for(lambda: nodes(gateway.url)[address]["state"] == "serving", "the watch to re-admit it")
    assert nodes(gateway.url)[address]["ejections"] == 1


def test_unavailable_answer_ejects_until_a_fresh_watch_says_serving(fakes, make_gateway):
    gateway = make_gateway([fake.address for fake in fakes[:2]])
    address = fakes[0].address
    # Health still says SERVING, but Generate answers UNAVAILABLE once.
    fakes[0].script.error_before = grpc.StatusCode.UNAVAILABLE
    assert httpx.post(f"{gateway.url}/v1/completions", json=BODY).status_code == 200
    assert _requests(fakes) == [1, 1, 0]
    fakes[0].script.error_before = None
    # The re-opened watch finds it SERVING: back in rotation without any health change.
    wait_for(lambda: nodes(gateway.url)[address]["state"] == "serving", "re-admission")
    view = nodes(gateway.url)[address]
    assert (view["ejections"], view["failures"]) == (1, 1)


def test_models_union_and_a_model_only_goes_to_its_engines(make_gateway):
    with FakeEngine("model-a") as a, FakeEngine("model-b") as b1, FakeEngine("model-b") as b2:
        gateway = make_gateway([a.address, b1.address, b2.address])
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["model-a", "model-b"]
            for _ in range(4):
                client.completions.create(model="model-b", prompt="x", max_tokens=1)
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="model-c", prompt="x", max_tokens=1)
        assert [len(e.record.requests) for e in (a, b1, b2)] == [0, 2, 2]
        # With model-a's only engine drained, model-a is not listed and its requests get 503.
        with admin(gateway.url) as client:
            assert client.post(f"/nodes/{a.address}/drain").status_code == 200
        models = httpx.get(f"{gateway.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["model-b"]
        response = httpx.post(f"{gateway.url}/v1/completions", json={"model": "model-a", "prompt": "x"})
        assert response.status_code == 503
