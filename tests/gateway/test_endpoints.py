"""GET /health, /metrics and /v1/models against the fake engine."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import MODEL
from tests.support.prometheus import scrape

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


def test_metrics_time_first_tokens_and_token_gaps_per_model(make_gateway, fake):
    gateway = make_gateway([fake.address])
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "n": 2, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        response.read()
    httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    httpx.post(f"{gateway.url}/v1/completions", json={"model": "no-such-model", "prompt": "x"})
    metrics = scrape(f"{gateway.url}/metrics")
    ttft = "conduit_gateway_time_to_first_token_seconds_count"
    assert metrics.value(ttft, endpoint="completions", model=MODEL) == 2
    # A gap per token after each choice's first: 2 choices x 4, then 1 choice x 2.
    assert metrics.value("conduit_gateway_inter_token_latency_seconds_count", model=MODEL) == 2 * 4 + 2
    # Only served models become label values.
    assert {labels["model"] for labels in metrics.labels(ttft)} == {MODEL}


def test_client_trace_context_reaches_the_engine_unchanged_without_tracing(http, fake):
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={"traceparent": traceparent, "tracestate": "a=1"},
    )
    metadata = fake.record.metadata[-1]
    assert (metadata["traceparent"], metadata["tracestate"]) == (traceparent, "a=1")
    http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert "traceparent" not in fake.record.metadata[-1]
