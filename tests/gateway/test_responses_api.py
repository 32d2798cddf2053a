"""The Responses API on the real stack: the engine (subprocess, stories260K) behind the real gateway app
(uvicorn on 127.0.0.1, the memory store, --tool-call-parser hermes), driven by the official openai SDK,
the OpenAI Agents SDK and raw HTTP for exact error bodies.

Greedy outputs are compared with what chat completions answers for the same conversation (the same
engine path), so the assertions are exact without hard-coding the model's text. Where the tiny model's
wits would decide (whether it calls a tool, whether its JSON fits a schema) the structure is forced with
tool_choice or text.format, which the engine's grammars enforce.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from typing import Annotated

import agents
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.clock import ManualClock
from tests.support.gateway_thread import GatewayThread
from tests.support.stories import MODEL, PROMPT, PROMPT_IDS

pytestmark = pytest.mark.integration

ENGINE_ARGS = ("--max-num-seqs", "16")  # read by the stories_engine fixture (conftest)
STORY = "Tell me a story"
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 9},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": True}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def gateway(stories_engine):
    with GatewayThread([stories_engine.address], tool_call_parser="hermes") as gw:
        yield gw


@pytest.fixture(scope="module")
def sdk(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.url, timeout=120) as client:
        yield client


def create(sdk: openai.OpenAI, **kwargs):
    return sdk.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 24, **kwargs})


def chat_reply(sdk: openai.OpenAI, messages: list[dict], max_tokens: int):
    return sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def tokenized(http: httpx.Client, messages: list[dict]) -> int:
    reply = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def error_of(http: httpx.Client, body: dict, status: int = 400) -> dict:
    reply = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 8, **body})
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


# -- create ------------------------------------------------------------------------------------------


def test_create_answers_what_chat_answers_for_the_same_conversation(sdk):
    response = create(sdk, input=STORY)
    chat = chat_reply(sdk, [{"role": "user", "content": STORY}], 24)
    (choice,) = chat.choices
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == choice.message.content
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    if choice.finish_reason == "length":
        assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert message.status == "incomplete"
    else:
        assert (response.status, response.incomplete_details) == ("completed", None)
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.store is True and response.background is False and response.model == MODEL


def test_stream_sends_the_typed_events_in_order(sdk):
    whole = create(sdk, input=STORY, max_output_tokens=12)
    events = list(create(sdk, input=STORY, max_output_tokens=12, stream=True))
    types = [event.type for event in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 12 tokens cut the story
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    done = events[-4]
    assert done.text == text and done.item_id == events[2].item.id
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete"
    assert sdk.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_parse_returns_the_pydantic_object(sdk):
    response = sdk.responses.parse(
        model=MODEL, input=STORY, text_format=Person, max_output_tokens=100, temperature=0
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Person)
    assert response.output_parsed == Person.model_validate_json(response.output_text)
    assert response.text.format.type == "json_schema"


def test_stream_helper_accumulates_the_events_into_the_parsed_response(sdk):
    with sdk.responses.stream(
        model=MODEL, input=STORY, text_format=Person, max_output_tokens=100, temperature=0
    ) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(texts) == final.output_text
    assert final.output_parsed == Person.model_validate_json(final.output_text)


def test_logprobs_come_with_the_output_text_when_included(sdk):
    kwargs = {"input": STORY, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = create(sdk, max_output_tokens=6, **kwargs)
    (part,) = response.output[0].content
    assert len(part.logprobs) == response.usage.output_tokens == 6 and response.top_logprobs == 2
    for entry in part.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    events = list(create(sdk, max_output_tokens=6, stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in part.logprobs]
    assert create(sdk, input=STORY, max_output_tokens=6).output[0].content[0].logprobs == []


def test_json_object_output_is_json(sdk):
    response = create(sdk, input=STORY, text={"format": {"type": "json_object"}}, max_output_tokens=200)
    assert response.output_text.startswith("{")
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


# -- tools -------------------------------------------------------------------------------------------


def test_forced_function_call_streamed_and_not_then_its_output_continues(sdk):
    response = create(sdk, input=STORY, tools=[WEATHER], tool_choice=FORCE_WEATHER, max_output_tokens=80)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)

    events = list(
        create(
            sdk, input=STORY, tools=[WEATHER], tool_choice=FORCE_WEATHER, max_output_tokens=80, stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == call.arguments
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["function_call"]
    assert events[-1].type == "response.completed"

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 20 C"}
    followed = create(
        sdk, previous_response_id=response.id, input=[answer], tools=[WEATHER], tool_choice="none"
    )
    assert followed.output[0].type == "message" and followed.previous_response_id == response.id
    items = sdk.responses.input_items.list(followed.id)
    assert [(item.type, item.call_id, item.output) for item in items.data] == [
        ("function_call_output", call.call_id, "sunny, 20 C")
    ]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_runs_the_tool_and_finishes(gateway, sdk, streamed):
    agents.set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(
        city: Annotated[str, Field(pattern="^[A-Z][a-z]{1,8}$")], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The weather in a city for the next days."""
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            # Forced on the first turn (the grammar writes the call); the SDK resets it to auto after.
            # The stop ends the answer turn within a few tokens (the call's JSON has no period).
            model_settings=agents.ModelSettings(
                tool_choice="get_weather", temperature=0, max_tokens=60, extra_body={"stop": ["."]}
            ),
        )
        try:
            if not streamed:
                return await agents.Runner.run(agent, STORY, max_turns=3)
            result = agents.Runner.run_streamed(agent, STORY, max_turns=3)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1
    city, days = calls[0]
    assert re.fullmatch("[A-Z][a-z]{1,8}", city) and 1 <= days <= 7
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.new_items[1].output == f"sunny in {city} for {days} days"
    # The answer turn is what the same conversation gets from /v1/responses directly.
    call = result.new_items[0].raw_item
    again = create(
        sdk,
        instructions="Answer with the weather.",
        input=[
            {"role": "user", "content": STORY},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": result.new_items[1].output},
        ],
        tools=[{"type": "function", "name": "get_weather", "parameters": get_weather.params_json_schema}],
        max_output_tokens=60,
        extra_body={"stop": ["."]},
    )
    assert result.final_output == again.output_text and again.status == "completed"


# -- the store ---------------------------------------------------------------------------------------


def test_retrieve_lists_input_items_by_page_and_delete_forgets(sdk, http):
    conversation = [
        {"role": "developer", "content": "Speak plainly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": STORY}]},
    ]
    response = create(sdk, input=conversation, instructions="Be kind.", max_output_tokens=8)
    expected = [{"role": "system", "content": "Be kind."}, {"role": "system", "content": "Speak plainly."}]
    expected += [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    expected += [{"role": "user", "content": STORY}]
    assert response.usage.input_tokens == tokenized(http, expected)
    assert sdk.responses.retrieve(response.id).output_text == response.output_text

    first = sdk.responses.input_items.list(response.id, order="asc", limit=3)
    assert [item.role for item in first.data] == ["developer", "user", "assistant"]
    assert first.has_more is True and first.first_id == first.data[0].id and first.last_id == first.data[2].id
    rest = sdk.responses.input_items.list(response.id, order="asc", limit=3, after=first.last_id)
    assert [item.content[0].text for item in rest.data] == [STORY] and rest.has_more is False
    newest = sdk.responses.input_items.list(response.id)  # default: newest first
    assert [item.id for item in newest.data] == [item.id for item in [*first.data, *rest.data]][::-1]

    sdk.responses.delete(response.id)
    for call in (lambda: sdk.responses.retrieve(response.id), lambda: sdk.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["param"] == "response_id"


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(sdk, http):
    opening = f"{PROMPT}, there was a little girl named Lily. She loved to play outside in the park."
    first = create(sdk, input=opening, max_output_tokens=16)
    second = create(sdk, previous_response_id=first.id, input="What happened next?", max_output_tokens=8)
    conversation = [
        {"role": "user", "content": opening},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What happened next?"},
    ]
    assert second.usage.input_tokens == tokenized(http, conversation)
    counted = sdk.responses.input_tokens.count(
        model=MODEL, previous_response_id=first.id, input="What happened next?"
    )
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", second.usage.input_tokens)
    assert second.output_text == chat_reply(sdk, conversation, 8).choices[0].message.content
    cached = second.usage.input_tokens_details.cached_tokens
    # The earlier turn's prompt blocks (16 tokens each) are reused, not recomputed.
    assert cached >= (first.usage.input_tokens // 16) * 16 and cached % 16 == 0

    unstored = create(
        sdk, previous_response_id=second.id, input="And then?", store=False, max_output_tokens=4
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)


def test_truncation_auto_drops_the_oldest_items_to_fit_the_context(sdk, http):
    long_turns = [{"role": "user", "content": f"{PROMPT} number {i}. " * 12} for i in range(8)]
    assert tokenized(http, long_turns) > 512  # stories260K's context
    error = error_of(http, {"input": long_turns})
    assert error["param"] == "input" and error["type"] == "invalid_request_error"
    fitted = create(sdk, input=long_turns, truncation="auto", max_output_tokens=8)
    assert fitted.truncation == "auto"
    assert fitted.usage.input_tokens + 8 <= 512
    # Exactly the newest items that fit with the 8 output tokens: the oldest were dropped one by one.
    kept = list(long_turns)
    while tokenized(http, kept) > 512 - 8:
        del kept[0]
    assert 0 < len(kept) < len(long_turns)
    assert fitted.usage.input_tokens == tokenized(http, kept)


# -- background, resume, cancel ----------------------------------------------------------------------


def test_background_resumes_after_any_sequence_number(sdk):
    queued = create(sdk, input=STORY, background=True, max_output_tokens=16)
    assert (queued.status, queued.background) == ("queued", True)
    everything = list(sdk.responses.retrieve(queued.id, stream=True))
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert [e.type for e in everything[:3]] == [
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
    ]
    resumed = list(sdk.responses.retrieve(queued.id, stream=True, starting_after=4))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in everything[5:]]
    final = sdk.responses.retrieve(queued.id)
    assert (
        final.status == everything[-1].response.status
        and final.output_text == everything[-1].response.output_text
    )
    assert final.output_text == create(sdk, input=STORY, max_output_tokens=16).output_text
    assert sdk.responses.cancel(queued.id).status == final.status  # already finished: unchanged


def test_cancel_stops_a_background_response(sdk, stories_engine):
    os.kill(stories_engine.process.pid, signal.SIGSTOP)  # the engine holds the request unanswered
    try:
        queued = create(sdk, input=STORY, background=True, max_output_tokens=16)
        cancelled = sdk.responses.cancel(queued.id)
    finally:
        os.kill(stories_engine.process.pid, signal.SIGCONT)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    assert sdk.responses.retrieve(queued.id).status == "cancelled"


def test_background_stream_on_create_follows_the_run(sdk):
    events = list(create(sdk, input=STORY, background=True, stream=True, max_output_tokens=8))
    assert events[0].type == "response.queued" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "image_generation_call", "id": "ig_1"}]}, 400, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input[0].role"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            400,
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input[0].content[0].type",
        ),
        ({"input": STORY, "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": STORY, "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        (
            {"input": STORY, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            400,
            "tool_choice",
        ),
        ({"input": STORY, "background": True, "store": False}, 400, "background"),
        ({"input": STORY, "n": 2}, 400, "n"),
        ({"input": STORY, "max_tokens": 5}, 400, "max_tokens"),
        (
            {"input": STORY, "text": {"format": {"type": "json_schema", "name": "x"}}},
            400,
            "text.format.schema",
        ),
        ({"input": STORY, "include": ["file_search_call.results"]}, 400, "include[0]"),
        ({"input": STORY, "unknown_field": 1}, 400, "unknown_field"),
        ({"input": STORY, "temperature": -1}, 400, "temperature"),
        ({}, 400, "input"),
    ],
)
def test_bad_requests_name_the_param(http, body, status, param):
    error = error_of(http, body, status)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_retrieve_cancel_and_stream_errors(sdk, http):
    assert http.get("/v1/responses/resp_missing").json()["error"]["code"] == "not_found"
    foreground = create(sdk, input=STORY, max_output_tokens=4)
    reply = http.post(f"/v1/responses/{foreground.id}/cancel")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "response_id"
    reply = http.get(f"/v1/responses/{foreground.id}", params={"stream": "true"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"
    reply = http.get(f"/v1/responses/{foreground.id}/input_items", params={"limit": 0})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "limit"


# -- tokenize, metrics -------------------------------------------------------------------------------


def test_tokenize_and_detokenize(http):
    reply = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["tokens"], body["count"], body["max_model_len"]) == (list(PROMPT_IDS), 5, 512)
    assert len(body["token_strs"]) == 5
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": PROMPT}]}).json()
    assert chat["count"] > 5
    both = http.post("/tokenize", json={"prompt": PROMPT, "messages": []})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    back = http.post("/detokenize", json={"model": MODEL, "tokens": list(PROMPT_IDS)})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    special = http.post("/detokenize", json={"tokens": list(PROMPT_IDS), "skip_special_tokens": False})
    assert special.json()["prompt"].endswith(PROMPT) and special.json()["prompt"] != PROMPT
    outside = http.post("/detokenize", json={"tokens": [1, 512]})  # stories260K's vocabulary is 512
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    unknown = http.post("/detokenize", json={"model": "nope", "tokens": [1]})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_metrics_count_responses_as_their_own_endpoint(sdk, http):
    create(sdk, input=STORY, max_output_tokens=2)
    text = http.get("/metrics").text
    assert (
        f'conduit_gateway_time_to_first_token_seconds_count{{endpoint="responses",model="{MODEL}"}}' in text
    )
    assert 'route="/v1/responses",status="200"' in text


# -- keys, limits, no store --------------------------------------------------------------------------


def test_keys_own_their_responses_and_a_background_run_counts_against_the_limits(stories_engine, tmp_path):
    keys = [{"name": "a", "key": "sk-a", "limits": {"requests_per_minute": 3}}, {"name": "b", "key": "sk-b"}]
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    settings = {"api_keys_file": str(tmp_path / "keys.json"), "max_concurrent_requests": 1}
    with GatewayThread([stories_engine.address], clock=ManualClock(), **settings) as gateway:
        a, b = (
            openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
            for key in ("sk-a", "sk-b")
        )
        made = create(a, input=STORY, max_output_tokens=4)  # a's first request
        assert a.responses.retrieve(made.id).id == made.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(made.id)  # another key's response does not exist for b
        with pytest.raises(openai.NotFoundError):
            create(b, input="More", previous_response_id=made.id)
        os.kill(stories_engine.process.pid, signal.SIGSTOP)
        try:
            queued = create(a, input=STORY, background=True)  # a's second request, holding the one slot
            with pytest.raises(openai.RateLimitError) as caught:
                create(b, input=STORY)
            assert "concurrent requests" in caught.value.message
            assert a.responses.cancel(queued.id).status == "cancelled"
        finally:
            os.kill(stories_engine.process.pid, signal.SIGCONT)
        assert create(b, input=STORY, max_output_tokens=2).status in ("completed", "incomplete")  # slot free
        create(a, input=STORY, max_output_tokens=2)  # a's third
        with pytest.raises(openai.RateLimitError):
            create(a, input=STORY, max_output_tokens=2)  # a's fourth: 3 per minute, the clock stands still


def test_without_a_store_nothing_is_kept_and_asking_for_it_is_a_400(stories_engine):
    with GatewayThread([stories_engine.address], response_store="none") as gateway:
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        response = create(sdk, input=STORY, max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response.id)
        for kwargs, param in (
            ({"store": True}, "store"),
            ({"previous_response_id": response.id}, "previous_response_id"),
            ({"background": True}, "background"),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                create(sdk, input=STORY, **kwargs)
            assert caught.value.body["param"] == param
