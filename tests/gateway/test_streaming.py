"""SSE exactly as OpenAI streams it, and non-streamed responses accumulated from the same engine stream
(fake engine: the shaping, indexing and usage are the gateway's)."""

from __future__ import annotations

import httpx
import pytest

from conduit_gateway.schemas.chat import ChatCompletionChunk
from conduit_gateway.schemas.completions import Completion
from tests.gateway.conftest import MODEL
from tests.gateway.sse import parse_events, post_stream
from tests.support.fake_engine import WORDS

pytestmark = pytest.mark.integration

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}]}


def test_chat_stream_event_sequence(http):
    response, events = post_stream(http, "/v1/chat/completions", {**CHAT, "max_tokens": 3, "stream": True})
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "Once"},
        {"content": " upon"},
        {"content": " a"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, None, "length"]
    assert {c["id"] for c in chunks} == {f"chatcmpl-{response.headers['x-request-id']}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {MODEL}
    assert len({c["created"] for c in chunks}) == 1
    assert all("usage" not in c and c["choices"][0]["logprobs"] is None for c in chunks)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)


def test_include_usage_adds_final_usage_chunk(http):
    body = {**CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    _, events = post_stream(http, "/v1/chat/completions", body)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert len(chunks) == 6  # the role, four tokens, the finish reason
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    # The fake counts "hi there" as 2 words + 2 per message + BOS = 5 prompt tokens.
    assert usage_chunk["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_continuous_usage_stats_carry_running_usage(http):
    body = {
        **CHAT,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    _, events = post_stream(http, "/v1/chat/completions", body)
    chunks = events[:-1]
    # role chunk (no tokens yet), 3 content chunks, finish chunk, final usage chunk
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8


def test_chat_stream_n2_indexes_each_choice(http):
    _, events = post_stream(http, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "n": 2, "stream": True})
    chunks = events[:-1]
    texts = {0: "", 1: ""}
    roles = {0: 0, 1: 0}
    finishes = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        roles[choice["index"]] += delta.get("role") == "assistant"
        texts[choice["index"]] += delta.get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert roles == {0: 1, 1: 1}
    assert texts == {0: "Once upon", 1: " upon a"}
    assert finishes == {0: ["length"], 1: ["length"]}


def test_chat_non_stream_accumulates(client, fake):
    result = client.chat.completions.create(**CHAT, max_tokens=5, n=2)
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].message.content == "".join(WORDS[:5])
    assert result.choices[1].message.content == "".join(WORDS[1:6])
    assert [c.finish_reason for c in result.choices] == ["length", "length"]
    assert result.choices[0].message.role == "assistant"
    assert result.object == "chat.completion"
    assert result.usage.completion_tokens == 10
    assert result.usage.prompt_tokens == 5
    assert result.usage.total_tokens == 15
    assert result.usage.prompt_tokens_details.cached_tokens == 0


def test_finish_reason_stop_is_reported(client, fake):
    from conduit.engine.v1 import engine_pb2

    fake.script.finish_reason = engine_pb2.FINISH_REASON_STOP
    result = client.chat.completions.create(**CHAT, max_tokens=2)
    assert result.choices[0].finish_reason == "stop"


def test_chat_logprobs_shape(client, fake):
    result = client.chat.completions.create(**CHAT, max_tokens=2, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["Once", " upon"]
    assert [entry.logprob for entry in content] == [-0.5, -0.5]
    assert content[1].bytes == list(b" upon")
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Once#1", -1.5), ("Once#2", -2.5)]
    assert fake.record.requests[-1].sampling.logprobs == 2


def test_chat_logprobs_stream(http):
    body = {**CHAT, "max_tokens": 1, "logprobs": True, "stream": True}
    _, events = post_stream(http, "/v1/chat/completions", body)
    content_chunk = events[1]
    assert content_chunk["choices"][0]["logprobs"] == {
        "content": [{"token": "Once", "logprob": -0.5, "bytes": list(b"Once"), "top_logprobs": []}],
        "refusal": None,
    }


def test_completions_prompt_list_indexes_prompt_times_n(client, fake):
    result = client.completions.create(model=MODEL, prompt=["one", "two words"], max_tokens=1, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == ["Once", " upon", "Once", " upon"]
    ids = sorted(r.request_id for r in fake.record.requests)
    assert ids == [f"{result.id.removeprefix('cmpl-')}-0", f"{result.id.removeprefix('cmpl-')}-1"]
    assert result.usage.prompt_tokens == 2 + 3  # summed over prompts
    assert result.usage.completion_tokens == 4


def test_completions_stream_prompt_list(http):
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, "n": 2, "stream": True}
    _, events = post_stream(http, "/v1/completions", body)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in events[:-1]:
        assert chunk["object"] == "text_completion"
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Once upon", 1: " upon a", 2: "Once upon", 3: " upon a"}
    assert finishes == dict.fromkeys(range(4), "length")


def test_completions_token_id_prompts(client, fake):
    client.completions.create(model=MODEL, prompt=[1, 403, 407], max_tokens=1)
    assert list(fake.record.requests[-1].token_ids.ids) == [1, 403, 407]
    client.completions.create(model=MODEL, prompt=[[1, 2], [3]], max_tokens=1)
    assert sorted(list(r.token_ids.ids) for r in fake.record.requests[-2:]) == [[1, 2], [3]]


def test_completions_logprobs_legacy_shape(client, fake):
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=1)
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == ["Once", " upon"]
    assert logprobs.token_logprobs == [-0.5, -0.5]
    assert logprobs.top_logprobs == [{"Once#1": -1.5, "Once": -0.5}, {" upon#1": -1.5, " upon": -0.5}]
    assert logprobs.text_offset == [0, 4]
    Completion.model_validate(result.model_dump())


def test_completions_stream_logprobs_offsets_continue(http):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 0, "stream": True}
    _, events = post_stream(http, "/v1/completions", body)
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in events[:-2]]
    assert offsets == [[0], [4], [9]]


def test_completions_echo_prepends_prompt(client, http):
    result = client.completions.create(model=MODEL, prompt="Say:", max_tokens=2, echo=True)
    assert result.choices[0].text == "Say:Once upon"
    _, events = post_stream(
        http,
        "/v1/completions",
        {"model": MODEL, "prompt": "Say:", "max_tokens": 2, "echo": True, "stream": True},
    )
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == "Say:Once upon"


def test_sampling_fields_reach_the_engine(client, fake):
    client.chat.completions.create(
        **CHAT,
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=1,
        seed=-1,
        stop=["\n", "END"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"42": 5.0},
        user="alice",
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "stop_token_ids": [7],
            "include_stop_str_in_output": True,
            "priority": -3,
        },
    )
    request = fake.record.requests[-1]
    sampling = request.sampling
    assert sampling.max_tokens == 7
    assert round(sampling.temperature, 6) == 0.5 and round(sampling.top_p, 6) == 0.9
    assert sampling.seed == 2**64 - 1  # OpenAI's signed seed, modulo 2**64
    assert list(sampling.stop) == ["\n", "END"]
    assert round(sampling.presence_penalty, 6) == 0.5 and round(sampling.frequency_penalty, 6) == -0.5
    assert dict(sampling.logit_bias) == {42: 5.0}
    assert sampling.top_k == 5 and round(sampling.min_p, 6) == 0.1
    assert round(sampling.repetition_penalty, 6) == 1.2
    assert sampling.min_tokens == 2 and sampling.ignore_eos and not sampling.skip_special_tokens
    assert list(sampling.stop_token_ids) == [7] and sampling.include_stop_str_in_output
    assert request.priority == -3
    assert request.model == MODEL
    assert not sampling.HasField("logprobs")


def test_unset_sampling_fields_stay_absent(client, fake):
    client.completions.create(model=MODEL, prompt="x")
    sampling = fake.record.requests[-1].sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "logprobs", "min_tokens"):
        assert not sampling.HasField(name), name


def test_chat_messages_map_to_chat_input(client, fake):
    client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "u",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        max_tokens=1,
    )
    chat = fake.record.requests[-1].chat
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be brief"),
        ("user", "a\nb"),
        ("assistant", ""),
        ("tool", "42"),
    ]
    assert chat.messages[1].name == "u"
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.type, call.function_name, call.function_arguments) == ("c1", "function", "f", "{}")
    assert chat.messages[3].tool_call_id == "c1"
    assert not chat.HasField("add_generation_prompt")


def test_the_clients_request_id_is_echoed_and_the_engine_gets_the_gateways_own(http, fake):
    ids = set()
    for _ in range(2):
        response = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-Id": "abc-123"}
        )
        assert response.headers["x-request-id"] == "abc-123"
        engine_id = fake.record.requests[-1].request_id
        assert engine_id != "abc-123" and len(engine_id) == 32
        assert response.json()["id"] == f"cmpl-{engine_id}"
        assert fake.record.metadata[-1]["x-request-id"] == engine_id
        ids.add(engine_id)
    assert len(ids) == 2  # one id per request, whatever the client sends


def test_request_id_generated_when_absent_or_unusable(http, fake):
    generated = http.get("/health").headers["x-request-id"]
    assert len(generated) == 32
    response = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x"},
        headers={"X-Request-Id": "bad id\twith spaces"},
    )
    assert response.headers["x-request-id"] != "bad id\twith spaces"
    assert fake.record.requests[-1].request_id == response.headers["x-request-id"]
    # error responses carry it too
    assert "x-request-id" in http.post("/v1/completions", content=b"{").headers


def test_tokens_are_forwarded_as_they_arrive(gateway, fake):
    """The engine holds after one token: the client must already have it (nothing is buffered)."""
    fake.script.hold_after = 1
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as raw,
        raw.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert parse_events(first + "\n\n")[0]["choices"][0]["text"] == "Once"
        fake.release()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert len(rest) == 4  # " upon", " a", the finish chunk, [DONE]


def test_prompt_logprobs_extra(http, fake):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 1}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_logprobs"] == [
        None,
        {
            "6": {"logprob": -0.5, "rank": 1, "decoded_token": "p6"},
            "7": {"logprob": -1.5, "rank": 2, "decoded_token": "p6#1"},
        },
        {
            "7": {"logprob": -0.5, "rank": 1, "decoded_token": "p7"},
            "8": {"logprob": -1.5, "rank": 2, "decoded_token": "p7#1"},
        },
    ]
    assert fake.record.requests[-1].sampling.prompt_logprobs == 1
    chat = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == 5
    # Absent, not null, when not asked for (OpenAI's shape).
    assert "prompt_logprobs" not in http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    refused = http.post("/v1/completions", json={**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
