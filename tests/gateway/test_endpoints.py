"""GET /health, /metrics and /v1/models against the fake engine, plus the pure helpers behind them."""

from __future__ import annotations

import json

import httpx
import pytest

from conduit_gateway.http.sse import ChunkEncoder
from conduit_gateway.http.validation import validation_error
from conduit_gateway.routing.selection import RoundRobinSelector, make_selector
from conduit_gateway.schemas.chat import ChatCompletionChunk
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.integration


def test_health_reports_engines(http, fake):
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "engines": [{"address": fake.address, "serving": True, "model": MODEL}],
    }


def test_models_list_and_retrieve(client):
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "conduit")]
    assert models[0].created > 0
    assert client.models.retrieve(MODEL).id == MODEL


def test_metrics_count_requests_and_tokens(http, client):
    client.completions.create(model=MODEL, prompt="one two", max_tokens=3)
    http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    text = http.get("/metrics").text
    assert 'conduit_gateway_requests_total{method="POST",route="/v1/completions",status="200"}' in text
    assert 'conduit_gateway_requests_total{method="POST",route="/v1/completions",status="404"}' in text
    assert "conduit_gateway_engine_up{engine=" in text
    assert "conduit_gateway_completion_tokens_total" in text
    assert "conduit_gateway_time_to_first_token_seconds_bucket" in text
    assert "conduit_gateway_generations_in_flight 0.0" in text


def test_metrics_completion_tokens_increase_exactly(make_gateway, fake):
    gateway = make_gateway([fake.address])
    for max_tokens in (2, 3):
        httpx.post(
            f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": max_tokens}
        )
    text = httpx.get(f"{gateway.url}/metrics").text
    assert "conduit_gateway_completion_tokens_total 5.0" in text
    assert "conduit_gateway_prompt_tokens_total 4.0" in text  # the fake counts "x" as 2 tokens (BOS + 1)


def test_round_robin_cycles_candidates():
    selector = RoundRobinSelector()
    picks = [selector.choose(["a", "b", "c"]) for _ in range(5)]
    assert picks == ["a", "b", "c", "a", "b"]
    assert isinstance(make_selector("round_robin"), RoundRobinSelector)


def test_chunk_encoder_builds_valid_chunks():
    usage = {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    choice = {"index": 0, "delta": {"content": 'quote " and \u00e9'}, "logprobs": None, "finish_reason": None}
    for mode, expected_usage in (("none", "absent"), ("final", None), ("running", usage)):
        encoder = ChunkEncoder(
            id="chatcmpl-1", object="chat.completion.chunk", created=7, model="m", usage_mode=mode
        )
        event = encoder.chunk([choice], lambda: usage)
        assert event.startswith("data: ") and event.endswith("\n\n")
        payload = json.loads(event[len("data: ") : -2])
        assert payload.get("usage", "absent") == expected_usage
        assert payload["choices"] == [choice]
        ChatCompletionChunk.model_validate(payload)
    final = json.loads(encoder.usage_chunk(usage)[len("data: ") : -2])
    assert final["choices"] == [] and final["usage"] == usage


def test_validation_error_params():
    union = [{"type": "int_type", "loc": ("body", "prompt", "list[int]", 0), "msg": "bad"}]
    assert validation_error(union).param == "prompt"
    nested = [{"type": "string_type", "loc": ("body", "messages", 2, "content", "str"), "msg": "bad"}]
    assert validation_error(nested).param == "messages[2].content"
    extra = validation_error([{"type": "extra_forbidden", "loc": ("body", "foo"), "msg": "x"}])
    assert (extra.param, extra.message) == ("foo", "Unrecognized request argument supplied: foo")
