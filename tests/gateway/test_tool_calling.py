"""Tool calls and reasoning end to end through the real gateway (SSE and not) with the fake engine
replaying scripted model text: the OpenAI shapes, finish reasons, and streamed deltas that reassemble
into exactly the non-streamed message; and the openai SDK's own helpers (parse, stream) on top."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from conduit.engine.v1 import engine_pb2
from tests.gateway.conftest import MODEL
from tests.gateway.parsed_output import message_view, reassemble_chat_stream
from tests.gateway.sse import post_stream
from tests.support.fake_engine import Script

pytestmark = pytest.mark.integration

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Weather in Paris and Oslo?"}],
    "tools": TOOLS,
}


@pytest.fixture
def parsing_client(parsing_gateway, fake):
    with openai.OpenAI(base_url=f"{parsing_gateway.url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def replay(fake, text: str, token_chars: int = 3, finish=engine_pb2.FINISH_REASON_STOP) -> None:
    """The fake engine answers every request with `text`, a few characters per token message."""
    pieces = [text[at : at + token_chars] for at in range(0, len(text), token_chars)]
    fake.script = Script(
        words=pieces, default_max_tokens=len(pieces), max_tokens_cap=len(pieces), finish_reason=finish
    )


def both_ways(http: httpx.Client, body: dict) -> tuple[dict, dict]:
    """(non-streamed choice, reassembled streamed choice) of one request, after checking they agree."""
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    _, events = post_stream(http, "/v1/chat/completions", {**body, "stream": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = reassemble_chat_stream(events)[0]
    view = message_view(choice["message"])
    # Ids are made per response; everything else must be identical.
    assert [call["name"] for call in streamed["tool_calls"]] == [call["name"] for call in view["tool_calls"]]
    for call in (*streamed["tool_calls"], *view["tool_calls"]):
        call.pop("id")
    assert {k: streamed[k] for k in ("content", "reasoning", "tool_calls")} == view
    assert streamed["finish_reason"] == choice["finish_reason"]
    return choice, streamed


def test_required_answers_with_tool_calls(parsing_http, fake):
    replay(
        fake,
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
    )
    choice, _ = both_ways(parsing_http, {**CHAT, "tool_choice": "required"})
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] is None and "reasoning_content" not in message
    assert [(c["type"], c["function"]["name"]) for c in message["tool_calls"]] == [
        ("function", "get_weather")
    ] * 2
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
        '{"city": "Paris"}',
        '{"city": "Oslo", "unit": "celsius"}',
    ]
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMETERS)


def test_named_function_streams_name_first_then_argument_fragments(parsing_http, fake):
    replay(fake, '{"name": "get_weather", "arguments": {"city": "Oslo"}}', token_chars=4)
    body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": True}
    _, events = post_stream(parsing_http, "/v1/chat/completions", body)
    deltas = [chunk["choices"][0]["delta"] for chunk in events[1:-1] if chunk["choices"][0]["delta"]]
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    fragments = [first["function"]["arguments"]] + [
        d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]
    ]
    assert len(fragments) > 2 and "".join(fragments) == '{"city": "Oslo"}'
    assert events[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }


def test_auto_parses_text_and_calls(parsing_http, fake):
    replay(
        fake,
        "Let me check both cities.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    )
    choice, _ = both_ways(parsing_http, {**CHAT, "tool_choice": "auto"})
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check both cities."
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == [
        '{"city": "Paris"}',
        "{}",
    ]


def test_auto_without_a_call_is_a_plain_answer(parsing_http, fake):
    replay(fake, "I can answer that without tools: it is sunny.")
    choice, _ = both_ways(parsing_http, CHAT)  # tool_choice defaults to auto
    assert choice == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": "I can answer that without tools: it is sunny.",
            "refusal": None,
        },
        "logprobs": None,
        "finish_reason": "stop",
    }


def test_tool_choice_none_leaves_tool_text_alone(parsing_http, fake):
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    replay(fake, text)
    choice, _ = both_ways(parsing_http, {**CHAT, "tool_choice": "none"})
    assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"


def test_reasoning_then_call(parsing_http, fake):
    replay(
        fake,
        "<think>\nThe user wants the weather; I should call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        token_chars=2,
    )
    choice, _ = both_ways(parsing_http, {**CHAT, "tool_choice": "auto"})
    message = choice["message"]
    assert (
        message["reasoning_content"]
        == message["reasoning"]
        == ("\nThe user wants the weather; I should call get_weather.\n")
    )
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"


def test_reasoning_then_answer_without_tools(parsing_http, fake):
    replay(fake, "<think>2 + 2 = 4</think>The answer is 4.", token_chars=1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "2 + 2?"}]}
    choice, _ = both_ways(parsing_http, body)
    assert choice["message"]["reasoning_content"] == "2 + 2 = 4"
    assert choice["message"]["content"] == "The answer is 4."
    assert choice["finish_reason"] == "stop"


def test_call_cut_by_max_tokens_ends_with_length(parsing_http, fake):
    replay(
        fake,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
        finish=engine_pb2.FINISH_REASON_LENGTH,
    )
    choice, _ = both_ways(parsing_http, {**CHAT, "tool_choice": "auto"})
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'


class Person(BaseModel):
    name: str
    age: int


def test_sdk_parse_returns_the_object(parsing_client, fake):
    replay(fake, '{"name": "Ada", "age": 36}')
    completion = parsing_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Who?"}], response_format=Person
    )
    assert completion.choices[0].message.parsed == Person(name="Ada", age=36)
    sampling = fake.record.requests[-1].sampling
    assert jsonschema.Draft202012Validator(json.loads(sampling.json_schema)).is_valid(
        {"name": "Ada", "age": 36}
    )
    assert sampling.structured_after == "</think>"


def test_sdk_parse_with_a_strict_function_tool(parsing_client, fake):
    replay(fake, '{"name": "Person", "arguments": {"name": "Ada", "age": 36}}')
    completion = parsing_client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Who?"}],
        tools=[openai.pydantic_function_tool(Person)],
        tool_choice={"type": "function", "function": {"name": "Person"}},
    )
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.parsed_arguments == Person(name="Ada", age=36)


def test_sdk_stream_accumulates_the_same_calls(parsing_client, fake):
    replay(
        fake,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        token_chars=1,
    )
    with parsing_client.chat.completions.stream(**CHAT, tool_choice="auto") as stream:
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
