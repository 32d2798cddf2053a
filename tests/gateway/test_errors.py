"""Every error status the gateway returns, through the openai SDK's exceptions and raw httpx:
the status code, the OpenAI error body and (for 429) Retry-After."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL
from tests.support.health import gateway_health
from tests.support.processes import free_port

pytestmark = pytest.mark.integration

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def post_json(http: httpx.Client, path: str, body: object) -> httpx.Response:
    # json.dumps escapes lone surrogates (\ud800) as JSON allows; httpx's own encoder refuses them.
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# -- 400 ------------------------------------------------------------------------------------------


def test_invalid_json_is_400(http):
    response = http.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"
    assert error["message"].startswith("Invalid JSON body")


def test_non_object_body_is_400(http):
    response = http.post("/v1/completions", json=[1, 2])
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # tool_choice defaults to auto, which this gateway (no --tool-call-parser) refuses.
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
        ({**CHAT, "audio": {"voice": "x", "format": "wav"}}, "audio"),
        ({**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        ({**CHAT, "store": True}, "store"),
        ({**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
        ({**CHAT, "not_a_field": 1}, "not_a_field"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            "messages[0].content[0].type",
        ),
        ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "temperature": 1e39}, "temperature"),
        ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({**CHAT, "top_k": 2**31}, "top_k"),
        ({**CHAT, "stop": ["\ud800"]}, "stop"),
        ({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        (
            {
                **CHAT,
                "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}],
                "tool_choice": "none",
            },
            "tools",
        ),
        (
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "description": "\ud800"}},
                },
            },
            "response_format.json_schema.schema",
        ),
        ({"messages": CHAT["messages"]}, "model"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_field(http, body, param):
    response = post_json(http, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": [[1], []]}, "prompt[1]"),
        ({"model": MODEL, "prompt": [-1]}, "prompt"),
        ({"model": MODEL, "prompt": {"a": 1}}, "prompt"),
        ({"model": MODEL, "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": MODEL, "prompt": "x", "suffix": "tail"}, "suffix"),
        ({"model": MODEL, "prompt": [1, 2], "echo": True}, "echo"),
        ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"model": MODEL, "prompt": "x", "logprobs": -1}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "stop_token_ids": [-5]}, "stop_token_ids"),
    ],
)
def test_bad_completion_parameters_are_400_naming_the_field(http, body, param):
    response = post_json(http, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_best_of_equal_to_n_is_accepted(client, fake):
    result = client.completions.create(model=MODEL, prompt="x", n=2, best_of=2, max_tokens=1)
    assert len(result.choices) == 2


def test_sdk_raises_bad_request_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**CHAT, functions=[{"name": "f"}])
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "functions"
    assert caught.value.body["type"] == "invalid_request_error"


def test_engine_invalid_argument_is_400_with_param(client, fake):
    fake.script.error_before = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.error_message = "temperature: must be >= 0, got -1.0"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**CHAT, temperature=-1)
    assert caught.value.body == {
        "message": "temperature: must be >= 0, got -1.0",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }


def test_engine_field_names_become_openai_names(client, fake):
    fake.script.error_before = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.error_message = "token_ids: token id 9999 outside the vocabulary [0, 512)"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[9999])
    assert caught.value.body["param"] == "prompt"
    assert caught.value.body["message"] == "prompt: token id 9999 outside the vocabulary [0, 512)"
    fake.script.error_message = "max_tokens: prompt (500 tokens) + max_tokens (100) exceeds max_model_len 512"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**CHAT, max_completion_tokens=100)
    assert caught.value.body["param"] == "max_completion_tokens"


def test_engine_invalid_argument_in_stream_is_still_400(http, fake):
    """Errors before the first token become the HTTP status even for stream=true."""
    fake.script.error_before = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.error_message = "stop: stop strings must not be empty"
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    assert response.status_code == 400
    assert error_of(response)["param"] == "stop"


# -- 401 ------------------------------------------------------------------------------------------


def test_api_keys(make_gateway, fake):
    gateway = make_gateway([fake.address], api_keys=("key-one", "key-two"))
    for key in ("key-one", "key-two"):
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0) as sdk:
            assert sdk.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].text == "Once"
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="key-three", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError) as caught:
            sdk.models.list()
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
    missing = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert missing.status_code == 401
    assert error_of(missing)["code"] == "invalid_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    # auth comes before body parsing: a bad body without a key is still 401
    assert httpx.post(f"{gateway.url}/v1/completions", content=b"{").status_code == 401
    # probes and scrapes need no key
    assert gateway_health(gateway.url) == 200
    assert httpx.get(f"{gateway.url}/metrics").status_code == 200


# -- 404 / 405 ------------------------------------------------------------------------------------


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(**{**CHAT, "model": "gpt-4"})
    assert caught.value.body == {
        "message": "The model `gpt-4` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    response = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"


def test_engine_not_found_is_404(client, fake):
    fake.script.error_before = grpc.StatusCode.NOT_FOUND
    fake.script.error_message = "model: unknown model 'x'"
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model=MODEL, prompt="x")
    assert caught.value.body["param"] == "model"


def test_unknown_path_is_404_and_wrong_method_405(http):
    response = http.post("/v1/embeddings", json={})
    assert response.status_code == 404
    assert error_of(response)["message"] == "Invalid URL (POST /v1/embeddings)"
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405
    assert error_of(response)["type"] == "invalid_request_error"


# -- 413 ------------------------------------------------------------------------------------------


def test_body_over_limit_is_413(make_gateway, fake):
    gateway = make_gateway([fake.address], max_body_bytes=2048)
    big = {"model": MODEL, "prompt": "x" * 4096}
    response = httpx.post(f"{gateway.url}/v1/completions", json=big)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"

    def chunks():
        yield b'{"model": "fake-model", "prompt": "'
        yield b"y" * 4096
        yield b'"}'

    chunked = httpx.post(
        f"{gateway.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 413
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as sdk:
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.completions.create(**big)
    assert caught.value.status_code == 413
    small = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert small.status_code == 200


# -- 429 ------------------------------------------------------------------------------------------


def test_engine_resource_exhausted_is_429_with_retry_after(client, http, fake):
    fake.script.error_before = grpc.StatusCode.RESOURCE_EXHAUSTED
    fake.script.error_message = "waiting queue is full (64 requests)"
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="x")
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.body["code"] == "rate_limit_exceeded"
    response = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert error_of(response)["message"] == "waiting queue is full (64 requests)"


def test_gateway_concurrency_limit_is_429(make_gateway, fake):
    gateway = make_gateway([fake.address], max_concurrent_requests=1, retry_after_s=3)
    fake.script.hold_after = 1
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
    with httpx.Client(base_url=gateway.url, timeout=30) as raw:
        with raw.stream("POST", "/v1/completions", json=body) as held:
            assert held.status_code == 200
            rejected = raw.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert rejected.status_code == 429
            assert rejected.headers["retry-after"] == "3"
            assert error_of(rejected)["type"] == "rate_limit_error"
            fake.release()
            held.read()
        # the slot is free again once the stream is done
        assert (
            raw.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code
            == 200
        )


# -- 503 ------------------------------------------------------------------------------------------


def test_no_engine_is_503(make_gateway):
    gateway = make_gateway([f"127.0.0.1:{free_port()}"])
    assert gateway_health(gateway.url) == 503
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as sdk:
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.chat.completions.create(**CHAT)
        assert caught.value.status_code == 503
        assert caught.value.body["code"] == "engine_unavailable"
        with pytest.raises(openai.InternalServerError):
            sdk.models.list()
    response = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 503 and error_of(response)["type"] == "server_error"


def test_engine_not_serving_is_503(make_gateway, fake):
    gateway = make_gateway([fake.address])
    fake.set_serving(False)
    assert gateway_health(gateway.url) == 503
    response = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 503
    fake.set_serving(True)
    assert gateway_health(gateway.url) == 200
    response = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 200


def test_engine_unavailable_status_is_503(client, fake):
    fake.script.error_before = grpc.StatusCode.UNAVAILABLE
    fake.script.error_message = "draining"
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=MODEL, prompt="x")
    assert caught.value.status_code == 503
