"""The Messages API on the real stack: the engine (subprocess) on a test-made copy of stories260K that renders
tools and thinks (tests/gateway/thinking_model.py; its context raised to 16K positions so a Claude-Code-sized
conversation fits) behind real gateways, driven by the official anthropic SDK, LangChain's ChatAnthropic and
raw HTTP.

Every text is the engine's greedy output. What the tiny model would not do by itself is forced the way the
structured-output tests force it: tool_choice any/tool and output_config.format through the engine's
grammar. The gateway without parsers gives the raw text each parsed answer is compared with.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.gateway.anthropic_events import names, post_events, reassemble
from tests.gateway.claude_code import FIRST_TURN, METADATA, SYSTEM, TOOLS, tool_result
from tests.gateway.thinking_model import write_thinking_model
from tests.support.processes import require_shared, start_engine, start_gateway
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

THINKING = "stories-thinking"
GREEDY = {"temperature": 0}
SAID = [{"role": "user", "content": "Tell me what he said"}]  # greedy: `"Hello,"</think> Tom. "I'm sorry...`
STORY = [{"role": "user", "content": "Tell me a story"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 10},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
}
ANY_ONE = {"type": "any", "disable_parallel_tool_use": True}
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in (WEATHER, TIME, *TOOLS)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_thinking_model(require_shared(f"models/{MODEL}"), tmp_path_factory.mktemp("m") / THINKING)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    with start_engine(folder, "--max-num-seqs", "8") as process:
        yield process


@pytest.fixture(scope="module")
def gateways(engine):
    """name → gateway process: raw (no parsers) and r1 (deepseek_r1 reasoning, hermes tool calls)."""
    flags = {"raw": (), "r1": ("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes")}
    started = {name: start_gateway(engine.address, *args) for name, args in flags.items()}
    yield started
    for gateway in started.values():
        gateway.stop()


@pytest.fixture(scope="module")
def raw(gateways):
    with anthropic.Anthropic(base_url=gateways["raw"].url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def r1(gateways):
    with anthropic.Anthropic(base_url=gateways["r1"].url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def r1_http(gateways):
    with httpx.Client(base_url=gateways["r1"].url, timeout=120) as client:
        yield client


def create(sdk: anthropic.Anthropic, messages: list, max_tokens: int = 40, **kwargs):
    return sdk.messages.create(
        model=THINKING, max_tokens=max_tokens, messages=messages, extra_body=GREEDY, **kwargs
    )


def streamed_and_not(http: httpx.Client, body: dict) -> tuple[dict, list]:
    """(the non-streamed Message, the streamed events); the events add up to the same Message (ids aside,
    and the usage split between input and cache reads, which the first request's prompt fills)."""
    body = {"model": THINKING, "max_tokens": 40, **GREEDY, **body}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    message = response.json()
    events = post_events(http, body)
    assert _comparable(reassemble(events)) == _comparable(message)
    return message, events


def _comparable(message: dict) -> dict:
    usage = message["usage"]
    return {
        **{key: value for key, value in message.items() if key not in ("id", "usage")},
        "content": [{**block, "id": None} if "id" in block else block for block in message["content"]],
        "prompt_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"],
        "output_tokens": usage["output_tokens"],
    }


@pytest.fixture(scope="module")
def raw_said(raw) -> str:
    text = create(raw, SAID).content[0].text
    assert text.startswith('"Hello,"</think> Tom.'), text  # the model writes the end tag's token
    return text


# -- text, stop sequences, usage -------------------------------------------------------------------


def test_sdk_create_stream_and_text_stream_agree(raw, gateways):
    message = create(raw, STORY)
    assert message.id.startswith("msg_") and message.model == THINKING and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 40
    (block,) = message.content
    with raw.messages.stream(model=THINKING, max_tokens=40, messages=STORY, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == block.text
        final = stream.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 40
    with httpx.Client(base_url=gateways["raw"].url, timeout=120) as http:
        streamed_and_not(http, {"messages": STORY})


def test_stop_sequence_ends_the_text_before_it(raw, raw_said):
    message = create(raw, SAID, stop_sequences=["sorry"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "sorry"
    assert message.content[0].text == raw_said[: raw_said.index("sorry")]


def test_count_tokens_is_the_whole_prompt_of_usage(r1, r1_http):
    tools = [WEATHER, TIME]
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "days": 2}}
    history = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    system = [{"type": "text", "text": "Be brief."}]
    counted = r1.messages.count_tokens(model=THINKING, system=system, messages=history, tools=tools)
    first = create(r1, history, max_tokens=2, system=system, tools=tools, tool_choice={"type": "none"})
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    again = create(r1, history, max_tokens=2, system=system, tools=tools, tool_choice={"type": "none"})
    assert again.usage.cache_read_input_tokens > 0  # the engine's prefix cache held the prompt
    assert counted.input_tokens == again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert again.usage.cache_creation_input_tokens == 0
    bare = r1.messages.count_tokens(model=THINKING, messages=SAID)
    assert bare.input_tokens < counted.input_tokens
    response = r1_http.post("/v1/messages/count_tokens", json={"model": THINKING, "messages": SAID})
    assert response.json() == {"input_tokens": bare.input_tokens}


# -- thinking ------------------------------------------------------------------------------------


def test_thinking_blocks_streamed_and_not(r1_http, raw_said):
    reasoning, _, answer = raw_said.partition("</think>")
    message, events = streamed_and_not(r1_http, {"messages": SAID, "thinking": {"type": "adaptive"}})
    thinking, text = message["content"]
    assert thinking == {"type": "thinking", "thinking": reasoning, "signature": thinking["signature"]}
    assert text == {"type": "text", "text": answer}
    assert names(events)[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert events[2][1]["content_block"]["type"] == "thinking"
    hidden, _ = streamed_and_not(r1_http, {"messages": SAID})  # thinking is off unless asked for
    assert hidden["content"] == [text]


def test_budget_tokens_caps_the_thinking(r1_http, raw, raw_said):
    for budget in (1, 3):
        first_tokens = create(raw, SAID, max_tokens=budget).content[0].text
        message, _ = streamed_and_not(
            r1_http, {"messages": SAID, "thinking": {"type": "enabled", "budget_tokens": budget}}
        )
        thinking, text = message["content"]
        assert thinking["thinking"] == first_tokens  # the reasoning stopped at its budget...
        assert text["type"] == "text" and text["text"]  # ...and the answer followed it
        assert message["usage"]["output_tokens"] == 40 and message["stop_reason"] == "max_tokens"
    # A budget the reasoning stays within changes nothing.
    message, _ = streamed_and_not(
        r1_http, {"messages": SAID, "thinking": {"type": "enabled", "budget_tokens": 20}}
    )
    reasoning, _, answer = raw_said.partition("</think>")
    assert [block.get("thinking", block.get("text")) for block in message["content"]] == [reasoning, answer]


# -- tools and structured output -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tool_choice", "allowed"),
    [
        ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "get_time"}),
        ({"type": "tool", "name": "get_weather"}, {"get_weather"}),
        ({"type": "tool", "name": "get_time"}, {"get_time"}),
    ],
)
def test_forced_tool_use_validates_streamed_and_not(r1_http, tool_choice, allowed):
    message, events = streamed_and_not(
        r1_http, {"messages": STORY, "tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 200}
    )
    assert message["stop_reason"] == "tool_use"
    (call,) = [block for block in message["content"] if block["type"] == "tool_use"]
    assert call["id"].startswith("toolu_") and call["name"] in allowed
    jsonschema.validate(call["input"], SCHEMAS[call["name"]])
    assert "input_json_delta" in {
        data["delta"]["type"] for name, data in events if name == "content_block_delta"
    }


def test_tool_results_continue_the_conversation(r1):
    tools = [WEATHER, TIME]
    asked = create(r1, STORY, max_tokens=200, tools=tools, tool_choice=ANY_ONE)
    uses = [block for block in asked.content if block.type == "tool_use"]
    assert asked.stop_reason == "tool_use" and uses
    with r1.messages.stream(
        model=THINKING, max_tokens=200, messages=STORY, tools=tools, tool_choice=ANY_ONE, extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()  # the SDK's own accumulation of input_json_delta
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]
    assert final.stop_reason == "tool_use"
    results = [
        {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "20C"}]}
        for use in uses
    ]
    history = [*STORY, {"role": "assistant", "content": asked.content}, {"role": "user", "content": results}]
    answer = create(r1, history, max_tokens=20, tools=tools, thinking={"type": "adaptive"})
    assert answer.content[0].type == "thinking" and answer.stop_reason in ("end_turn", "max_tokens")
    assert {block.type for block in answer.content} <= {"thinking", "text"}


def test_output_config_format_gives_json_that_validates(r1_http):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for thinking in (None, {"type": "enabled", "budget_tokens": 3}):
        body = {"messages": SAID, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
        message, _ = streamed_and_not(
            r1_http, {**body, "max_tokens": 80, **({"thinking": thinking} if thinking else {})}
        )
        assert message["stop_reason"] == "end_turn"
        jsonschema.validate(json.loads(message["content"][-1]["text"]), schema)


# -- LangChain ---------------------------------------------------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def chat_anthropic(gateways):
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(
        model=THINKING,
        base_url=gateways["r1"].url,
        api_key="unused",
        temperature=0,
        max_tokens=160,
        max_retries=0,
    )


def test_langchain_invoke_and_stream(chat_anthropic, raw_said):
    from langchain_core.messages import HumanMessage

    answer = raw_said.partition("</think>")[2]
    reply = chat_anthropic.invoke("Tell me what he said")
    assert reply.content.startswith(answer)  # 160 tokens here, 40 in the raw text
    assert reply.response_metadata["stop_reason"] == "max_tokens"
    assert reply.usage_metadata["output_tokens"] == 160
    chunks = list(chat_anthropic.stream("Tell me what he said"))
    streamed = "".join(chunk.text for chunk in chunks)
    assert streamed == reply.text
    usage = reply.usage_metadata
    assert (
        chat_anthropic.get_num_tokens_from_messages([HumanMessage("Tell me what he said")])
        == usage["input_tokens"]
    )


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    happy: bool


class GetWeather(BaseModel):
    """The weather in a city for some days."""

    city: str = Field(min_length=1, max_length=10)
    days: int = Field(ge=1, le=7)


def test_langchain_bind_tools_and_structured_output(chat_anthropic):
    # The forced output follows the reasoning; this prompt's reasoning ends at its fifth token.
    bound = chat_anthropic.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False)
    reply = bound.invoke("Tell me what he said")
    assert reply.tool_calls, (reply.content, reply.response_metadata)
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("toolu_")
    GetWeather.model_validate(call["args"])
    assert reply.response_metadata["stop_reason"] == "tool_use"
    structured = chat_anthropic.with_structured_output(Person, include_raw=True)
    result = structured.invoke("Tell me what he said")
    assert result["parsing_error"] is None, result["raw"]
    assert isinstance(result["parsed"], Person)
    # method="json_schema" sends output_config.format; LangChain drops the length and range limits from the
    # schema there (Anthropic's structured outputs take none), so this shape is bounded by enums instead.
    as_schema = chat_anthropic.with_structured_output(Pet, method="json_schema")
    assert isinstance(as_schema.invoke("Tell me what he said"), Pet)


# -- Claude Code -----------------------------------------------------------------------------------


def test_a_claude_code_session_streams_turn_after_turn(r1, r1_http):
    """Eight streamed turns shaped as Claude Code sends them (system blocks, its tools, tool results fed
    back, thinking on), the first seven forced to call one tool (a tiny model, free to call several, would
    not stop); every turn keeps the event grammar, its
    prompt is what count_tokens says, and the engine's prefix cache holds the conversation so far."""
    messages: list = [FIRST_TURN]
    base = {
        "model": THINKING,
        "max_tokens": 256,
        "system": SYSTEM,
        "tools": TOOLS,
        "metadata": METADATA,
        "thinking": {"type": "enabled", "budget_tokens": 8},
        **GREEDY,
    }
    cached = []
    for turn in range(8):
        forced = turn < 7
        body = {**base, "messages": messages, **({"tool_choice": ANY_ONE} if forced else {})}
        counted = r1.messages.count_tokens(
            model=THINKING, system=SYSTEM, tools=TOOLS, messages=messages, thinking=base["thinking"]
        ).input_tokens
        events = post_events(r1_http, body, headers={"anthropic-version": "2023-06-01", "x-api-key": "k"})
        message = reassemble(events)
        usage = message["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted
        cached.append(usage["cache_read_input_tokens"])
        kinds = [block["type"] for block in message["content"]]
        assert kinds[0] == "thinking"
        if not forced:
            assert message["stop_reason"] in ("end_turn", "max_tokens") and "tool_use" not in kinds
            break
        assert message["stop_reason"] == "tool_use", json.dumps(message["content"])
        uses = [block for block in message["content"] if block["type"] == "tool_use"]
        for use in uses:
            jsonschema.validate(use["input"], SCHEMAS[use["name"]])
        messages = [
            *messages,
            {"role": "assistant", "content": message["content"]},
            {"role": "user", "content": [tool_result(use, turn) for use in uses]},
        ]
    assert len(cached) == 8 and counted > 2000  # a long prompt by now
    assert all(later > earlier for earlier, later in zip(cached[1:], cached[2:], strict=False))
