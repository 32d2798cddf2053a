"""A bounded schemathesis run over every operation in /openapi.json (valid and invalid inputs, against
the fake engine): the gateway never answers 5xx and every error has the OpenAI body (Anthropic's on the
Messages API)."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.integration

EXAMPLES_PER_MODE = 150
N_CAP = 2


def check_response(case, response) -> None:
    where = f"{case.method} {case.path} body={case.body!r} headers={case.headers!r}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:500]}"
    if response.status_code >= 400:
        body = json.loads(response.text)
        error = body["error"]
        if case.path.startswith("/v1/messages"):  # Anthropic's error shape on the Messages API
            assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", where
            assert set(error) == {"type", "message"}, where
        else:
            assert set(error) == {"message", "type", "param", "code"}, where
        assert isinstance(error["message"], str) and error["message"], where


def test_openapi_document_lists_the_endpoints(http):
    document = http.get("/openapi.json").json()
    assert set(document["paths"]) >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/v1/models/{model_id}",
        "/health",
        "/metrics",
    }
    # Validation errors are OpenAI 400s here, not FastAPI's 422.
    for path in document["paths"].values():
        for operation in path.values():
            assert "422" not in operation["responses"]


def test_schemathesis_finds_no_server_errors(gateway, fake):
    # Fuzzed requests may hold 2048 prompts with n=128: keep the fake's work per stream tiny.
    fake.script.max_tokens_cap = 2
    fake.script.n_cap = N_CAP
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    strategy = schema.as_strategy(GenerationMode.POSITIVE) | schema.as_strategy(GenerationMode.NEGATIVE)
    calls = []

    @given(case=strategy)
    @settings(
        max_examples=2 * EXAMPLES_PER_MODE,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            # A random model name only ever reaches the 404 path; the served one reaches the engine.
            case.body["model"] = MODEL
        if isinstance(case.body, dict) and type(case.body.get("n")) is int and case.body["n"] > N_CAP:
            # The fake makes at most N_CAP choices; an engine that ends the stream short of n is a 502.
            case.body["n"] = N_CAP
        response = case.call(base_url=gateway.url, timeout=30)
        calls.append(response.status_code)
        check_response(case, response)

    fuzz()
    # The run really exercised the API: both successes and refusals happened.
    assert any(code == 200 for code in calls)
    assert any(400 <= code < 500 for code in calls)
