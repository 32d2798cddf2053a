"""Structured outputs and tools on the request side, against the fake engine: what each spelling sets in
GenerateRequest (the engine sees exactly these proto fields) and the 400s, each naming its parameter."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest

from conduit.engine.v1 import engine_pb2
from conduit_common.structured import MAX_STRUCTURED_SPEC_BYTES
from tests.gateway.conftest import MODEL
from tests.gateway.test_errors import error_of, post_json

pytestmark = pytest.mark.integration

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sent(http: httpx.Client, fake, path: str, body: dict) -> engine_pb2.GenerateRequest:
    response = post_json(http, path, body)
    assert response.status_code == 200, response.text
    return fake.record.requests[-1]


# -- mapping -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("extra", "field", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
            "json_schema",
            compact(PERSON),
        ),
        ({"structured_outputs": {"json": PERSON}}, "json_schema", compact(PERSON)),
        ({"structured_outputs": {"json": json.dumps(PERSON)}}, "json_schema", compact(PERSON)),
        ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, "regex", r"\d{3}-\d{4}"),
        ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, "grammar", 'root ::= "yes" | "no"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"guided_json": PERSON}, "json_schema", compact(PERSON)),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_grammar": "root ::= [0-9]+"}, "grammar", "root ::= [0-9]+"),
    ],
)
def test_each_spelling_sets_its_constraint(http, fake, path, extra, field, value):
    base = CHAT if path.endswith("chat/completions") else COMPLETION
    sampling = sent(http, fake, path, {**base, **extra}).sampling
    assert sampling.WhichOneof("structured") == field
    assert getattr(sampling, field) == value
    assert not sampling.HasField("structured_after")
    assert not sampling.HasField("structured_any_whitespace")


@pytest.mark.parametrize(
    "extra", [{"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}]
)
def test_choice_lists_the_strings(http, fake, extra):
    sampling = sent(http, fake, "/v1/chat/completions", {**CHAT, **extra}).sampling
    assert list(sampling.choice.choices) == ["yes", "no"]


def test_no_constraint_and_text_format_set_nothing(http, fake):
    for extra in ({}, {"response_format": {"type": "text"}}, {"structured_outputs": {"json_object": False}}):
        sampling = sent(http, fake, "/v1/chat/completions", {**CHAT, **extra}).sampling
        assert sampling.WhichOneof("structured") is None


@pytest.mark.parametrize(("compact_json", "any_whitespace"), [(True, False), (False, True)])
def test_whitespace_switch(http, fake, compact_json, any_whitespace):
    body = {**CHAT, "structured_outputs": {"json_object": True, "disable_any_whitespace": compact_json}}
    assert sent(http, fake, "/v1/chat/completions", body).sampling.structured_any_whitespace is any_whitespace


def test_tools_reach_the_template_for_every_tool_choice(parsing_http, fake):
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        request = sent(
            parsing_http,
            fake,
            "/v1/chat/completions",
            {**CHAT, "tools": [WEATHER, TIME], "tool_choice": choice},
        )
        assert json.loads(request.chat.tools_json) == [WEATHER, TIME]
        if choice in ("none", "auto"):
            assert request.sampling.WhichOneof("structured") is None


def test_no_tools_no_tools_json(http, fake):
    assert not sent(http, fake, "/v1/chat/completions", {**CHAT, "tool_choice": "none"}).chat.HasField(
        "tools_json"
    )


def test_required_constrains_to_an_array_of_calls(parsing_http, fake):
    body = {**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"}
    schema = json.loads(sent(parsing_http, fake, "/v1/chat/completions", body).sampling.json_schema)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}], good[0]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_without_parallel_calls_is_one_call(parsing_http, fake):
    body = {**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    schema = json.loads(sent(parsing_http, fake, "/v1/chat/completions", body).sampling.json_schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)


def test_named_function_allows_only_that_function(http, fake):
    body = {
        **CHAT,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    schema = json.loads(sent(http, fake, "/v1/chat/completions", body).sampling.json_schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for bad in ({"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_local_refs_of_parameters_still_resolve(http, fake):
    # What pydantic generates for nested models (the OpenAI Agents SDK's function tools).
    parameters = {
        "$defs": {
            "City": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
        },
        "type": "object",
        "properties": {"cities": {"type": "array", "items": {"$ref": "#/$defs/City"}, "minItems": 1}},
        "required": ["cities"],
    }
    tool = {"type": "function", "function": {"name": "plan", "parameters": parameters}}
    for choice, wrap in (
        ("required", lambda call: [call]),
        ({"type": "function", "function": {"name": "plan"}}, lambda call: call),
    ):
        body = {**CHAT, "tools": [tool, TIME], "tool_choice": choice}
        schema = json.loads(sent(http, fake, "/v1/chat/completions", body).sampling.json_schema)
        jsonschema.validate(wrap({"name": "plan", "arguments": {"cities": [{"name": "Oslo"}]}}), schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrap({"name": "plan", "arguments": {"cities": [{"nom": "Oslo"}]}}), schema)


def test_reasoning_parser_delays_the_constraint_until_the_reasoning_ends(parsing_http, http, fake):
    body = {**CHAT, "response_format": {"type": "json_object"}}
    assert sent(parsing_http, fake, "/v1/chat/completions", body).sampling.structured_after == "</think>"
    assert not sent(http, fake, "/v1/chat/completions", body).sampling.HasField("structured_after")
    # Completions get no reasoning parsing, so no delay either.
    completion = {**COMPLETION, "response_format": {"type": "json_object"}}
    assert not sent(parsing_http, fake, "/v1/completions", completion).sampling.HasField("structured_after")


def test_parsers_on_special_tokens_keep_them_in_the_text(make_gateway, parsing_http, fake):
    body = {**CHAT, "tools": [WEATHER], "tool_choice": "auto"}
    # hermes tags are plain text: the engine's default stays.
    assert not sent(parsing_http, fake, "/v1/chat/completions", body).sampling.HasField("skip_special_tokens")
    mistral = make_gateway([fake.address], tool_call_parser="mistral")
    with httpx.Client(base_url=mistral.url, timeout=30) as http:
        assert sent(http, fake, "/v1/chat/completions", body).sampling.skip_special_tokens is False
        asked = {**body, "skip_special_tokens": True}
        assert sent(http, fake, "/v1/chat/completions", asked).sampling.skip_special_tokens is True
        plain = sent(http, fake, "/v1/chat/completions", CHAT).sampling
        assert not plain.HasField("skip_special_tokens")


def test_earlier_replies_go_back_unchanged(parsing_http, fake):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "reasoning_content": "r",
            "reasoning": "r",
        },
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"},
    ]
    chat = sent(
        parsing_http, fake, "/v1/chat/completions", {**CHAT, "messages": messages, "tools": [WEATHER]}
    ).chat
    (sent_call,) = chat.messages[1].tool_calls
    assert (sent_call.id, sent_call.type, sent_call.function_name, sent_call.function_arguments) == (
        "call_1",
        "function",
        "get_weather",
        '{"city": "Oslo"}',
    )
    assert (chat.messages[2].role, chat.messages[2].content, chat.messages[2].tool_call_id) == (
        "tool",
        "-3 C",
        "call_1",
    )


# -- errors ------------------------------------------------------------------------------------------

BAD = {"type": "objec"}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            "response_format.json_schema.name",
            "required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
            "response_format.json_schema.schema",
            "not a valid JSON schema: 'objec' is not valid under any of the given schemas (at $.type)",
        ),
        (
            {"guided_json": {"properties": {"a": {"minimum": "x"}}}},
            "guided_json",
            "at $.properties.a.minimum",
        ),
        ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
        ({"guided_json": {"$ref": "#/$defs/Missing"}}, "guided_json", "does not point into the schema"),
        (
            {"structured_outputs": {"json": {"$ref": "https://example.com/s.json"}}},
            "structured_outputs.json",
            "only local refs",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "not a valid regular expression"),
        (
            {"structured_outputs": {"regex": "a{2,1}"}},
            "structured_outputs.regex",
            "not a valid regular expression",
        ),
        ({"guided_choice": []}, "guided_choice", "at least one"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "choice 1 is empty"),
        ({"guided_grammar": " "}, "guided_grammar", "must not be empty"),
        (
            {"guided_grammar": "root ::= " + '"a" ' * (MAX_STRUCTURED_SPEC_BYTES // 4)},
            "guided_grammar",
            f"over the limit of {MAX_STRUCTURED_SPEC_BYTES}",
        ),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "disable_any_whitespace"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "cannot be combined with response_format",
        ),
        (
            {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
            "structured_outputs.choice",
            "cannot be combined with structured_outputs.regex",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "Unrecognized",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_constraints_are_400_naming_the_parameter(http, fake, path, extra, param, words):
    base = CHAT if path.endswith("chat/completions") else COMPLETION
    response = post_json(http, path, {**base, **extra})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param
    assert words in error["message"]
    assert not fake.record.requests  # refused before any engine saw it


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope' is not one of the tools (get_weather)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER]}, "tool_choice", "--tool-call-parser"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name", "defined twice"),
        (
            {"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "none"},
            "tools[0].function.name",
            "empty",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD}}],
                "tool_choice": "none",
            },
            "tools[0].function.parameters",
            "not a valid JSON schema",
        ),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0].type", "function"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "none"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined with tool_choice 'required'",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": f"f{i}",
                            "description": "x" * 2000,
                            "parameters": {"description": "y" * 4000},
                        },
                    }
                    for i in range(40)
                ],
                "tool_choice": "required",
            },
            "tools",
            "the tool-call schema built from the tools is",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_parameter(http, fake, extra, param, words):
    response = post_json(http, "/v1/chat/completions", {**CHAT, **extra})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize(
    ("extra", "param", "engine_message"),
    [
        (
            {"response_format": {"type": "json_object"}},
            "response_format",
            "sampling.structured: structured outputs are not supported yet",
        ),
        # The engine's own spelling of a compile failure (the real engine names `sampling.<member>`).
        ({"guided_regex": "a+"}, "guided_regex", "sampling.regex: does not compile: lookbehind"),
        (
            {"structured_outputs": {"grammar": "root ::= x"}},
            "structured_outputs.grammar",
            "sampling.grammar: does not compile: Rule x is not defined",
        ),
        # One forced tool: the engine's complaint is about its parameters (the wrapper is the gateway's).
        (
            {"tools": [WEATHER], "tool_choice": "required"},
            "tools[0].function.parameters",
            "sampling.json_schema: does not compile: unsupported",
        ),
        # Several tools under `required`: the complaint may be about any of them.
        (
            {"tools": [WEATHER, TIME], "tool_choice": "required"},
            "tool_choice",
            "sampling.json_schema: does not compile: unsupported",
        ),
    ],
)
def test_engine_refusals_of_the_constraint_name_the_request_field(http, fake, extra, param, engine_message):
    fake.script.error_before = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.error_message = engine_message
    response = post_json(http, "/v1/chat/completions", {**CHAT, **extra})
    assert response.status_code == 400
    assert error_of(response) == {
        "message": f"{param}: {engine_message.partition(': ')[2]}",
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
