"""Structured outputs and forced tool calls through the real stack: the engine (subprocess, stories260K)
behind the real gateway (subprocess), driven by the official openai SDK and raw HTTP.

Every document that ends with `stop` validates against its schema; regex, choice and grammar outputs
match; forced tool calls carry arguments that validate against the tool's parameters, streamed and not,
and the streamed deltas add up to the non-streamed message; unconstrained requests batched with
constrained ones keep exactly their tokens."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.gateway.parsed_output import chat_streamed_and_not
from tests.gateway.schema_cases import SCHEMAS
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS_BODY = {
    "model": MODEL,
    "messages": MESSAGES,
    "max_tokens": 200,
    "temperature": 0,
    "tools": [WEATHER, TIME],
}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


ENGINE_ARGS = ("--max-num-seqs", "64")  # read by the stories_engine fixture (conftest)


@pytest.fixture(scope="module")
def http(stories_gateway):
    with httpx.Client(base_url=stories_gateway.url, timeout=120) as client:
        yield client


def chat(sdk: openai.OpenAI, **kwargs):
    kwargs = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 200, **kwargs}
    return sdk.chat.completions.create(**kwargs).choices[0]


def complete(sdk: openai.OpenAI, **kwargs):
    kwargs = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 200, **kwargs}
    return sdk.completions.create(**kwargs).choices[0]


# -- JSON ------------------------------------------------------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


def test_sdk_parse_returns_the_pydantic_object(stories_sdk):
    result = stories_sdk.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=100, temperature=0
    )
    (choice,) = result.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)


def _schema_run(sdk: openai.OpenAI, name: str, schema: dict, api: str):
    """Chat with response_format (greedy), or completions with guided_json (sampled with a seed)."""
    if api == "chat":
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        choice = chat(sdk, response_format=rf)
        return choice.finish_reason, choice.message.content
    choice = complete(sdk, temperature=0.9, seed=7, extra_body={"structured_outputs": {"json": schema}})
    return choice.finish_reason, choice.text


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_schema_gives_documents_that_validate(stories_sdk, api):
    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(8) as pool:  # batched in the engine, as concurrent clients are
        runs = list(pool.map(lambda item: _schema_run(stories_sdk, *item, api), SCHEMAS.items()))
    for (name, schema), (finish, text) in zip(SCHEMAS.items(), runs, strict=True):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)


def test_max_tokens_first_gives_length_and_a_cut_document(stories_sdk):
    rf = {"type": "json_schema", "json_schema": {"name": "nested", "schema": SCHEMAS["nested"]}}
    choice = chat(stories_sdk, response_format=rf, max_tokens=6)
    assert choice.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


def test_json_object_is_compact_json_by_default(stories_sdk):
    """The model would write newlines (its stories have them); the default grammar allows none."""
    choice = chat(stories_sdk, response_format={"type": "json_object"}, max_tokens=300)
    assert choice.message.content.startswith("{")
    assert "\n" not in choice.message.content  # whitespace limited: no newlines, no indentation
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


# -- regex, choice, grammar ------------------------------------------------------------------------

REGEX = r"(yes|no), [a-z]{2,8}\."
GRAMMAR = 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\ncolor ::= "red" | "blue"'
GRAMMAR_REGEX = r"The (cat|dog) is (red|blue)\."


@pytest.mark.parametrize(
    ("extra", "matches"),
    [
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_regex": r"[0-9]{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
        ({"structured_outputs": {"choice": ["Lily", "Tom", "Ben"]}}, lambda t: t in ("Lily", "Tom", "Ben")),
        ({"guided_choice": ['say "hi"', "a\\b"]}, lambda t: t in ('say "hi"', "a\\b")),
        ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(GRAMMAR_REGEX, t)),
        ({"guided_grammar": 'root ::= [a-c] [a-c]? [a-c]? "!"'}, lambda t: re.fullmatch(r"[a-c]{1,3}!", t)),
    ],
)  # fmt: skip
def test_regex_choice_and_grammar_outputs_match(stories_sdk, extra, matches):
    for seed in (None, 3):
        temperature = 0 if seed is None else 1.0
        text = chat(stories_sdk, extra_body=extra, seed=seed, temperature=temperature)
        assert text.finish_reason == "stop" and matches(text.message.content), text.message.content
        done = complete(stories_sdk, extra_body=extra, seed=seed, temperature=temperature)
        assert done.finish_reason == "stop" and matches(done.text), done.text


# -- forced tool calls -----------------------------------------------------------------------------


def _validated_calls(message: dict) -> list[tuple[str, dict]]:
    calls = []
    for call in message["tool_calls"]:
        name, arguments = call["name"], json.loads(call["arguments"])
        jsonschema.validate(arguments, PARAMETERS[name])
        calls.append((name, arguments))
    return calls


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"tool_choice": "required", "parallel_tool_calls": False}, {"get_weather", "get_time"}),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, {"get_time"}),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, {"get_weather"}),
    ],
)
def test_forced_calls_validate_streamed_and_not(http, extra, names):
    choice, message = chat_streamed_and_not(http, {**TOOLS_BODY, **extra})
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = _validated_calls(message)
    assert call[0] in names
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])


def test_required_parallel_calls_validate_and_stream_the_same(http):
    choice, message = chat_streamed_and_not(
        http, {**TOOLS_BODY, "max_tokens": 120, "tool_choice": "required"}
    )
    calls = message["tool_calls"]
    complete_calls = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]  # length: cut short
    assert complete_calls, message
    _validated_calls({"tool_calls": complete_calls})


# -- batch parity ----------------------------------------------------------------------------------


def test_unconstrained_requests_keep_their_tokens_beside_constrained_ones(stories_sdk):
    free = [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 11},
        {"temperature": 1.2, "seed": 5, "top_p": 0.9, "presence_penalty": 0.5},
    ]
    alone = [complete(stories_sdk, max_tokens=48, **kwargs).text for kwargs in free]
    constrained = [{"structured_outputs": {"json": s}} for s in list(SCHEMAS.values())[:8]]
    constrained += [{"guided_regex": REGEX}, {"guided_grammar": GRAMMAR}]
    jobs = [("free", kwargs) for kwargs in free] * 2 + [("constrained", extra) for extra in constrained]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _batch_job(stories_sdk, *job), jobs))
    assert results[: 2 * len(free)] == alone * 2


def _batch_job(sdk: openai.OpenAI, kind: str, kwargs: dict) -> str:
    if kind == "free":
        return complete(sdk, max_tokens=48, **kwargs).text
    return complete(sdk, extra_body=kwargs, max_tokens=48).text


# -- LangChain -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(stories_gateway, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{stories_gateway.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=120,
        max_retries=0,
    )
    structured = llm.with_structured_output(Person, method=method, include_raw=True)
    result = structured.invoke("Tell me about a girl")
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Person)
    if method == "function_calling":
        assert result["raw"].tool_calls[0]["name"] == "Person"


# -- errors ----------------------------------------------------------------------------------------

OVER_LIMIT_GRAMMAR = "root ::= " + '"a" ' * 40_000  # 160 KB: over the 128 KiB limit
TYPO_SCHEMA = {"type": "objec"}
UNDEFINED_RULE = 'EBNF parser error at line 1, column 10: Rule "foo" is not defined'
LOOKBEHIND = "(?<=a)b"  # Python's re compiles it; the engine's grammar backend does not


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": TYPO_SCHEMA}}},
         "response_format.json_schema.schema", "is not a valid JSON schema"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "string", "pattern": LOOKBEHIND}}}},
         "guided_json", "does not compile: Regex parsing error at position 3: Lookbehind is not supported"),
        ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
         "structured_outputs.json", "uses 'uniqueItems' (at $), which the grammar backend does not enforce"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "function 'nope' is not one of the tools (get_weather)"),
        ({"structured_outputs": {"grammar": OVER_LIMIT_GRAMMAR}},
         "structured_outputs.grammar", "over the limit of 131072"),
        ({"guided_regex": "a{2,1}"}, "guided_regex", "is not a valid regular expression"),
        ({"structured_outputs": {"regex": LOOKBEHIND}},
         "structured_outputs.regex", "does not compile: Regex parsing error at position 3: Lookbehind"),
        ({"guided_grammar": "root ::= foo"},
         "guided_grammar", f"does not compile: {UNDEFINED_RULE}"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_errors_are_400_naming_the_parameter(http, extra, param, words, stream):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": stream, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and words in error["message"], error["message"]


def test_the_engine_serves_on_after_refusing_specs(stories_sdk, stories_engine):
    import grpc

    from conduit.engine.v1 import engine_pb2, engine_pb2_grpc

    with pytest.raises(openai.BadRequestError):
        chat(stories_sdk, extra_body={"guided_grammar": "root ::= foo"})
    assert chat(stories_sdk, extra_body={"guided_choice": ["Lily"]}).message.content == "Lily"
    with grpc.insecure_channel(stories_engine.address) as channel:
        load = engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    assert load.running_requests == 0 and load.waiting_requests == 0 and load.kv_blocks_used == 0
