"""The Messages API (/v1/messages) against a scripted fake engine: exact event sequences (text, tool_use
from the hermes parser, thinking from the qwen3 parser, ping while the engine is silent, an error event
mid-stream), and the error table in Anthropic's shape (400 naming the field, 401, 404, 413, 429 with
Anthropic's rate-limit headers, 529), through raw HTTP and the official anthropic SDK."""

from __future__ import annotations

import json
import re

import anthropic
import grpc
import httpx
import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.messages import MessagesHandler
from tests.gateway.anthropic_events import names, parse_events, post_events, reassemble
from tests.gateway.conftest import MODEL
from tests.support.clock import ManualClock
from tests.support.fake_engine import Script
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration

BODY = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL_WORDS = (
    "Let",
    " me",
    " check.",
    "<tool_call>",
    '{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Oslo"}}',
    "</tool_call>",
)


@pytest.fixture
def http(gateway, fake):
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


@pytest.fixture
def sdk(gateway, fake):
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as client:
        yield client


def _delta(index: int, kind: str, **fields) -> tuple[str, dict]:
    return "content_block_delta", {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": kind, **fields},
    }


# -- events ----------------------------------------------------------------------------------------


def test_text_stream_is_exactly_anthropics_event_sequence(http, fake):
    events = post_events(http, BODY)
    prompt_tokens = 4  # the fake counts a chat prompt as its words + 2 per message + 2
    usage = {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    message_id = events[0][1]["message"]["id"]
    assert re.fullmatch(r"msg_[0-9a-f]{32}", message_id)
    assert events == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": MODEL,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {**usage, "output_tokens": 0},
                },
            },
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        _delta(0, "text_delta", text="Once"),
        _delta(0, "text_delta", text=" upon"),
        _delta(0, "text_delta", text=" a"),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                "usage": {**usage, "output_tokens": 3},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    plain = http.post("/v1/messages", json=BODY).json()
    assert plain["content"] == [{"type": "text", "text": "Once upon a"}]
    assert {k: v for k, v in reassemble(events).items() if k != "id"} == {
        k: v for k, v in plain.items() if k != "id"
    }
    (request,) = fake.record.requests[-1:]
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "hi")]
    assert request.sampling.max_tokens == 3


def test_sdk_create_stream_and_text_stream(sdk, fake):
    fake.script = Script(finish_reason=engine_pb2.FINISH_REASON_STOP)
    message = sdk.messages.create(**BODY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [block.model_dump(exclude_none=True) for block in message.content] == [
        {"type": "text", "text": "Once upon a"}
    ]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 3)
    with sdk.messages.stream(**BODY) as stream:
        assert "".join(stream.text_stream) == "Once upon a"
        final = stream.get_final_message()
    assert [block.text for block in final.content] == ["Once upon a"] and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 3
    streamed = sdk.messages.create(**BODY, stream=True)
    assert [event.type for event in streamed] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # the SDK skips ping


def test_auto_tool_call_becomes_a_tool_use_block(parsing_gateway, fake):
    fake.script = Script(words=CALL_WORDS, finish_reason=engine_pb2.FINISH_REASON_STOP)
    body = {**BODY, "max_tokens": len(CALL_WORDS), "tools": [WEATHER]}
    with httpx.Client(base_url=parsing_gateway.url, timeout=30) as http:
        events = post_events(http, body)
        plain = http.post("/v1/messages", json=body).json()
    tool_use = events[7][1]["content_block"]
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", tool_use["id"])
    assert events[6:10] == [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": tool_use}),
        _delta(1, "input_json_delta", partial_json='{"city": '),
        _delta(1, "input_json_delta", partial_json='"Oslo"}'),
    ]
    assert names(events) == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "content_block_start",
        *["content_block_delta"] * 2,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert tool_use == {"type": "tool_use", "id": tool_use["id"], "name": "get_weather", "input": {}}
    message = reassemble(events)
    assert message["content"][0] == {"type": "text", "text": "Let me check."}
    assert message["content"][1] == {**tool_use, "input": {"city": "Oslo"}}
    assert message["stop_reason"] == "tool_use"
    assert plain["content"][0] == {"type": "text", "text": "Let me check."}
    assert plain["content"][1]["input"] == {"city": "Oslo"} and plain["stop_reason"] == "tool_use"
    (request,) = fake.record.requests[-1:]
    assert json.loads(request.chat.tools_json) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]


def test_thinking_blocks_only_when_thinking_is_on(parsing_gateway, fake):
    words = ("<think>", "I", " think", "</think>", "Hi", "!")
    fake.script = Script(words=words, finish_reason=engine_pb2.FINISH_REASON_STOP)
    body = {**BODY, "max_tokens": len(words)}
    with httpx.Client(base_url=parsing_gateway.url, timeout=30) as http:
        events = post_events(http, {**body, "thinking": {"type": "adaptive"}})
        plain = http.post("/v1/messages", json={**body, "thinking": {"type": "adaptive"}}).json()
        hidden = http.post("/v1/messages", json=body).json()
        omitted = http.post(
            "/v1/messages", json={**body, "thinking": {"type": "adaptive", "display": "omitted"}}
        ).json()
    signature = plain["content"][0]["signature"]
    assert events[2:9] == [
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        ),
        _delta(0, "thinking_delta", thinking="I"),
        _delta(0, "thinking_delta", thinking=" think"),
        _delta(0, "signature_delta", signature=signature),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        ),
        _delta(1, "text_delta", text="Hi"),
    ]
    assert plain["content"] == [
        {"type": "thinking", "thinking": "I think", "signature": signature},
        {"type": "text", "text": "Hi!"},
    ]
    assert reassemble(events)["content"] == plain["content"]
    assert hidden["content"] == [{"type": "text", "text": "Hi!"}]  # thinking is off by default
    assert omitted["content"] == [
        {"type": "thinking", "thinking": "", "signature": signature},
        plain["content"][1],
    ]


def test_ping_keeps_a_silent_stream_alive(gateway, fake, monkeypatch):
    monkeypatch.setattr(MessagesHandler, "ping_interval_s", 0.05)
    fake.script = Script(hold_after=2)
    seen: list[str] = []
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as http,
        http.stream("POST", "/v1/messages", json={**BODY, "stream": True}) as response,
    ):
        buffer = ""
        for text in response.iter_text():
            buffer += text
            if names(parse_events(buffer[: buffer.rfind("\n\n") + 2]))[-1:] == ["ping"] and (
                "text_delta" in buffer and not seen
            ):
                seen.append("ping while held")
                fake.release()
    events = parse_events(buffer)
    assert seen == ["ping while held"]
    assert [name for name in names(events) if name != "ping"] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    second_delta = [i for i, name in enumerate(names(events)) if name == "content_block_delta"][1]
    assert "ping" in names(events)[second_delta:]  # after the held tokens, before the rest


def test_engine_failure_mid_stream_is_an_error_event(http, sdk, fake):
    fake.script = Script(error_after=2, error_code=grpc.StatusCode.INTERNAL)
    events = post_events(http, {**BODY, "max_tokens": 5})
    assert names(events) == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "error",
    ]
    error = events[-1][1]
    assert error["error"] == {"type": "api_error", "message": "The engine failed to process the request."}
    assert error["request_id"]
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        sdk.messages.stream(**{**BODY, "max_tokens": 5}) as stream,
    ):
        stream.get_final_message()
    assert caught.value.body["error"]["type"] == "api_error"


# -- errors ----------------------------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}
CALLED = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}],
}


def _with(**fields) -> dict:
    return {**BODY, **fields}


def _blocks(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
SEARCH = {"type": "search_result", "source": "s", "title": "t", "content": []}
SCHEMA = {"type": "json_schema", "schema": {"type": "object"}}

BAD_REQUESTS = [
    ({k: v for k, v in BODY.items() if k != "max_tokens"}, "max_tokens: Field required"),
    (_with(max_tokens=0), "max_tokens: must be in [1, 4294967295], got 0"),
    (_with(max_tokens=True), "max_tokens: Input should be a valid integer"),
    (_with(max_tokens="5"), "max_tokens: Input should be a valid integer"),
    (_with(messages=[]), "messages: must hold at least one message"),
    (_with(messages=[{"role": "system", "content": "x"}]),
     "messages[0].role: Input should be 'user' or 'assistant'"),
    (_with(messages=[USER, {"role": "assistant", "content": "The answer is ("}]),
     "messages[1].role: a final assistant message (prefill) is not supported by this server"),
    (_with(messages=_blocks({"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"})),
     "messages[0].content[0].tool_use_id: no tool_use block with id 'toolu_9' in the previous assistant "
     "message"),
    (_with(messages=[USER, CALLED, *_blocks({"type": "tool_result", "tool_use_id": "toolu_2"})]),
     "messages[2].content[0].tool_use_id: no tool_use block with id 'toolu_2'"),
    (_with(messages=_blocks({"type": "text", "text": "look"}, IMAGE)),
     "messages[0].content[1].type: 'image' blocks are not supported by this server"),
    (_with(messages=_blocks(DOCUMENT)), "messages[0].content[0].type: 'document' blocks are not supported"),
    (_with(messages=[USER, CALLED, *_blocks({"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": [SEARCH]})]),
     "messages[2].content[0].content[0].type: 'search_result' blocks are not supported"),
    (_with(messages=_blocks({"type": "tool_use", "id": "t", "name": "n", "input": {}})),
     "messages[0].content[0].type: tool_use blocks belong in assistant messages"),
    (_with(messages=_blocks({"type": "text"})), "messages[0].content[0].text: is required for a text block"),
    (_with(temperature=1.5), "temperature: must be in [0, 1], got 1.5"),
    (_with(top_p=-0.1), "top_p: must be in [0, 1], got -0.1"),
    (_with(top_k=-2), "top_k: must be >= 0, got -2"),
    (_with(stop_sequences=[""]), "stop_sequences[0]: must not be empty"),
    (_with(thinking={"type": "enabled"}),
     "thinking.budget_tokens: is required when thinking.type is 'enabled'"),
    (_with(thinking={"type": "enabled", "budget_tokens": 3}),
     "thinking.budget_tokens: must be >= 1 and less than max_tokens (3), got 3"),
    (_with(thinking={"type": "sometimes"}), "thinking.type: Input should be"),
    (_with(tool_choice={"type": "any"}), "tool_choice: needs tools: the request defines none"),
    (_with(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
     "tool_choice: tool 'nope' is not one of the tools (get_weather)"),
    (_with(tools=[WEATHER], tool_choice={"type": "tool"}),
     "tool_choice.name: is required when tool_choice.type"),
    (_with(tools=[WEATHER]), "tool_choice: 'auto' needs a tool-call parser"),
    (_with(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "tools[0].type: server tool 'web_search_20250305' is not supported by this server"),
    (_with(tools=[{"name": "x", "input_schema": {"type": "objec"}}], tool_choice={"type": "any"}),
     "tools[0].input_schema: is not a valid JSON schema"),
    (_with(tools=[WEATHER, WEATHER], tool_choice={"type": "any"}),
     "tools[1].name: 'get_weather' is defined twice"),
    (_with(output_config={"format": {"type": "json_schema", "schema": {"type": 5}}}),
     "output_config.format.schema: is not a valid JSON schema"),
    (_with(output_config={"format": SCHEMA}, tools=[WEATHER], tool_choice={"type": "any"}),
     "output_config.format: cannot be combined with tool_choice 'any' or 'tool'"),
    (_with(output_config={"effort": "extreme"}), "output_config.effort: Input should be"),
    (_with(frequency_penalty=1), "Unrecognized request argument supplied: frequency_penalty"),
]  # fmt: skip


LONE_SURROGATE = "\ud800"  # JSON can carry it, protobuf strings cannot
BAD_REQUESTS += [
    (_with(tools=[{**WEATHER, "description": LONE_SURROGATE}], tool_choice={"type": "none"}),
     "tools: must be valid UTF-8 text (it contains a lone surrogate)"),
    (_with(system=LONE_SURROGATE), "system: must be valid UTF-8 text"),
    (_with(stop_sequences=[LONE_SURROGATE]), "stop_sequences[0]: must be valid UTF-8 text"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message"), BAD_REQUESTS)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_anthropic_400s_naming_the_field(http, body, message, stream):
    # json.dumps escapes lone surrogates as JSON allows; httpx's own encoder refuses them.
    content = json.dumps({**body, "stream": stream})
    response = http.post("/v1/messages", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": error["error"]["message"]},
        "request_id": response.headers["request-id"],
    }
    assert error["error"]["message"].startswith(message), error["error"]["message"]
    assert response.headers["request-id"] == response.headers["x-request-id"]


def test_count_tokens_validates_like_messages(http):
    body = {k: v for k, v in BODY.items() if k != "max_tokens"}
    response = http.post("/v1/messages/count_tokens", json={**body, "messages": _blocks(IMAGE)})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("messages[0].content[0].type: 'image' blocks")
    response = http.post("/v1/messages/count_tokens", json={**body, "model": "nope"})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    tools = [{**WEATHER, "name": LONE_SURROGATE}]
    content = json.dumps({**body, "tools": tools}).encode()
    response = http.post(
        "/v1/messages/count_tokens", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(
        "tools: must be valid"
    )


@pytest.mark.parametrize(
    ("request_kwargs", "status", "kind", "message"),
    [
        ({"json": {**BODY, "model": "gpt-9"}}, 404, "not_found_error", "The model `gpt-9` does not exist"),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400,
         "invalid_request_error", "Invalid JSON body"),
        ({"json": [1, 2]}, 400, "invalid_request_error", "The request body must be a JSON object"),
    ],
)  # fmt: skip
def test_not_found_and_bad_bodies(http, request_kwargs, status, kind, message):
    response = http.post("/v1/messages", **request_kwargs)
    assert response.status_code == status
    assert response.json()["error"]["type"] == kind
    assert response.json()["error"]["message"].startswith(message)


def test_unknown_path_is_not_found_error(http):
    response = http.post("/v1/messages/batches", json={})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "type": "not_found_error",
        "message": "Invalid URL (POST /v1/messages/batches)",
    }


def test_body_over_the_limit_is_413_request_too_large(make_gateway, fake):
    gateway = make_gateway([fake.address], max_body_bytes=2048)
    response = httpx.post(f"{gateway.url}/v1/messages", json=_with(system="x" * 4096))
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"


def test_no_engine_ready_is_529_overloaded(make_gateway, fake):
    gateway = make_gateway([fake.address])
    fake.set_serving(False)
    try:
        response = httpx.post(f"{gateway.url}/v1/messages", json=BODY)
        assert response.status_code == 529
        assert response.json()["error"]["type"] == "overloaded_error"
        with (
            anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0) as sdk,
            pytest.raises(anthropic.OverloadedError),
        ):
            sdk.messages.create(**BODY)
    finally:
        fake.set_serving(True)


def test_engine_statuses_map_to_anthropic_errors(sdk, fake):
    fake.script.error_before = grpc.StatusCode.RESOURCE_EXHAUSTED
    fake.script.error_message = "the queue is full"
    with pytest.raises(anthropic.RateLimitError) as caught:
        sdk.messages.create(**BODY)
    assert caught.value.body["error"] == {"type": "rate_limit_error", "message": "the queue is full"}
    assert caught.value.response.headers["retry-after"] == "1"
    fake.script.error_before = grpc.StatusCode.UNAVAILABLE
    fake.script.error_message = "draining"
    with pytest.raises(anthropic.OverloadedError):
        sdk.messages.create(**BODY)
    fake.script.error_before = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.error_message = "stop: too many stop strings"
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(**BODY)
    assert caught.value.body["error"]["message"] == "stop_sequences: too many stop strings"


# -- keys and limits -------------------------------------------------------------------------------

KEYS = [{"name": "team", "key": "sk-team", "limits": {"requests_per_minute": 2, "tokens_per_minute": 60}}]


@pytest.fixture(scope="module")
def keyed(fake_engine_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    clock = ManualClock(0.0)
    with GatewayThread([fake_engine_server.address], clock=clock, api_keys_file=str(path)) as gateway:
        yield gateway, clock


def test_x_api_key_or_bearer_authenticates(keyed, fake):
    gateway, clock = keyed
    clock.now += 600  # full buckets
    url = f"{gateway.url}/v1/messages"
    missing = httpx.post(url, json=BODY)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(url, json=BODY, headers={"x-api-key": "sk-wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "Incorrect API key provided."
    with anthropic.Anthropic(base_url=gateway.url, api_key="sk-wrong", max_retries=0) as sdk:
        with pytest.raises(anthropic.AuthenticationError):
            sdk.messages.create(**BODY)
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "sk-team"}
    assert httpx.post(url, json=BODY, headers=headers).status_code == 200
    assert httpx.post(url, json=BODY, headers={"authorization": "Bearer sk-team"}).status_code == 200


def test_limits_carry_anthropic_headers_and_429_is_rate_limit_error(keyed, fake):
    gateway, clock = keyed
    clock.now += 600
    with anthropic.Anthropic(base_url=gateway.url, api_key="sk-team", max_retries=0) as sdk:
        first = sdk.messages.with_raw_response.create(**BODY)
        headers = first.headers
        assert headers["anthropic-ratelimit-requests-limit"] == headers["x-ratelimit-limit-requests"] == "2"
        assert headers["anthropic-ratelimit-requests-remaining"] == "1"
        assert headers["anthropic-ratelimit-tokens-limit"] == "60"
        assert headers["anthropic-ratelimit-tokens-remaining"] == "53"  # 4 prompt + 3 output tokens
        for kind in ("requests", "tokens"):
            assert re.fullmatch(
                r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", headers[f"anthropic-ratelimit-{kind}-reset"]
            )
        sdk.messages.create(**BODY)
        with pytest.raises(anthropic.RateLimitError) as caught:
            sdk.messages.create(**BODY)
    refused = caught.value.response
    assert refused.status_code == 429 and refused.headers["retry-after"] == "30"
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert caught.value.body["error"]["message"].startswith(
        "Rate limit reached for API key 'team' on requests"
    )


def test_metrics_count_the_messages_endpoint(http, gateway, fake):
    post_events(http, BODY)
    http.post("/v1/messages", json=BODY)
    metrics = http.get("/metrics").text
    assert re.search(
        r'conduit_gateway_time_to_first_token_seconds_count\{endpoint="messages",model="fake-model"\} [1-9]',
        metrics,
    )
    assert re.search(
        r'conduit_gateway_requests_total\{method="POST",route="/v1/messages",status="200"\} [1-9]', metrics
    )


# -- the request mapping ---------------------------------------------------------------------------


def test_blocks_map_onto_the_engines_chat_messages(parsing_http, fake):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    body = {
        **BODY,
        "system": [
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be kind."},
        ],
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "user", "content": [{"type": "text", "text": "In Oslo."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "They want Oslo.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    call,
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "down"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "metadata": {"user_id": "u-1"},
        "stop_sequences": ["\n\nHuman:"],
        "top_k": 5,
    }
    response = parsing_http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    (request,) = fake.record.requests[-1:]
    messages = [
        (
            m.role,
            m.content,
            [(c.id, c.function_name, json.loads(c.function_arguments)) for c in m.tool_calls],
            m.tool_call_id,
        )
        for m in request.chat.messages
    ]
    assert messages == [
        ("system", "Be brief.\nBe kind.", [], ""),
        ("user", "Weather?\nIn Oslo.", [], ""),
        ("assistant", "Checking.", [("toolu_1", "get_weather", {"city": "Oslo"})], ""),
        ("tool", "Error: down", [], "toolu_1"),
        ("user", "And tomorrow?", [], ""),
    ]
    assert list(request.sampling.stop) == ["\n\nHuman:"] and request.sampling.top_k == 5
    assert not request.sampling.HasField("temperature")  # the engine's default, as Anthropic's is 1.0


def test_a_full_context_before_max_tokens_says_so(http, fake):
    fake.script = Script(max_tokens_cap=4)  # the engine stops at 4 tokens with `length`: its context is full
    message = http.post("/v1/messages", json={**BODY, "max_tokens": 100}).json()
    assert message["stop_reason"] == "model_context_window_exceeded"
    assert message["usage"]["output_tokens"] == 4


def test_client_disconnect_mid_stream_cancels_the_engine_stream(gateway, fake, monkeypatch):
    monkeypatch.setattr(MessagesHandler, "ping_interval_s", 0.05)  # the heartbeat is waiting too
    fake.script = Script(hold_after=1)
    fake.record.cancelled = 0
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as http,
        http.stream("POST", "/v1/messages", json={**BODY, "max_tokens": 50, "stream": True}) as response,
    ):
        buffer = ""
        for text in response.iter_text():
            buffer += text
            if "text_delta" in buffer:
                break
    wait_for(lambda: fake.record.cancelled == 1, "the engine to see the cancellation")
    assert fake.record.completed == 0
    wait_for(lambda: gateway.ctx.limiter.active == 0, "the gateway to release the request")


def test_models_speak_anthropic_to_anthropic_clients(sdk, http):
    (model,) = sdk.models.list().data
    assert (model.id, model.type, model.display_name, model.lifecycle) == (MODEL, "model", MODEL, "active")
    assert model.max_input_tokens == 512 and model.created_at.year >= 2026
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(anthropic.NotFoundError) as caught:
        sdk.models.retrieve("nope")
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert http.get("/v1/models").json()["object"] == "list"  # OpenAI's shape without anthropic-version


def test_the_sdks_beta_client_works_as_claude_code_uses_it(sdk, fake):
    """Claude Code calls the beta endpoints: /v1/messages?beta=true with anthropic-beta headers."""
    betas = ["interleaved-thinking-2025-05-14", "fine-grained-tool-streaming-2025-05-14"]
    message = sdk.beta.messages.create(**BODY, betas=betas)
    assert [block.text for block in message.content] == ["Once upon a"]
    with sdk.beta.messages.stream(**BODY, betas=betas) as stream:
        assert [block.text for block in stream.get_final_message().content] == ["Once upon a"]
    counted = sdk.beta.messages.count_tokens(model=MODEL, messages=BODY["messages"], betas=betas)
    assert counted.input_tokens == 0  # the fake's Tokenize counts the words of a text prompt only
