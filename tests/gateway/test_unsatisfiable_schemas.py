"""Schemas and grammars that admit no output are a 400 naming the field that carried them, on every API
that takes one, rather than a 500 `engine_error` at the first token: the real engine (stories260K) behind
the real gateway, driven by the official openai SDK; the engine itself refuses them over gRPC with
INVALID_ARGUMENT naming its field. Satisfiable recursive schemas still generate valid documents."""

from __future__ import annotations

import json

import anthropic
import grpc
import jsonschema
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
NO_INSTANCE = {
    "ref_to_root": {"$ref": "#"},
    "ref_cycle": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "two_step_cycle": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a",
    },
    "required_false": {"type": "object", "required": ["x"], "properties": {"x": False}},
    "empty_enum": {"enum": []},
    "not_anything": {"not": {}},
    "required_self": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    "nonempty_self_array": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "required_not_allowed": {"type": "object", "required": ["x"], "additionalProperties": False},
    "const_of_another_type": {"type": "string", "const": 1},
    # Found by the engine (the gateway does not read patterns): the output would stop at the quote.
    "pattern_matching_nothing": {"type": "string", "pattern": "^[^\\s\\S]$"},
}
LINKED_LIST = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer", "minimum": 0, "maximum": 9},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["value", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


def _chat_response_format(sdk: openai.OpenAI, schema: object):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, response_format=rf)


def _completions_structured_outputs(sdk: openai.OpenAI, schema: object):
    body = {"structured_outputs": {"json": schema}}
    return sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, extra_body=body)


def _forced_tool_parameters(sdk: openai.OpenAI, schema: object):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    return sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
    )


def _responses_text_format(sdk: openai.OpenAI, schema: object):
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    return sdk.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=64, text=text)


FIELDS = {
    "response_format.json_schema.schema": _chat_response_format,
    "structured_outputs.json": _completions_structured_outputs,
    "tools[0].function.parameters": _forced_tool_parameters,
    "text.format.schema": _responses_text_format,
}


@pytest.mark.parametrize("name", NO_INSTANCE)
@pytest.mark.parametrize("param", FIELDS)
def test_schema_without_instance_is_400_naming_its_field(stories_sdk, param, name):
    with pytest.raises(openai.BadRequestError) as refused:
        FIELDS[param](stories_sdk, NO_INSTANCE[name])
    error = refused.value
    assert (error.status_code, error.param, error.type) == (400, param, "invalid_request_error")
    assert error.body["message"].startswith(f"{param}: "), error.body


def _messages_tool_input_schema(sdk: anthropic.Anthropic, schema: object):
    tool = {"name": "f", "input_schema": schema}
    return sdk.messages.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )


def _messages_output_config(sdk: anthropic.Anthropic, schema: object):
    output = {"format": {"type": "json_schema", "schema": schema}}
    return sdk.messages.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, extra_body={"output_config": output}
    )


MESSAGES_FIELDS = {
    "tools[0].input_schema": _messages_tool_input_schema,
    "output_config.format.schema": _messages_output_config,
}


@pytest.fixture(scope="module")
def anthropic_sdk(stories_gateway):
    with anthropic.Anthropic(base_url=stories_gateway.url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.mark.parametrize("name", NO_INSTANCE)
@pytest.mark.parametrize("param", MESSAGES_FIELDS)
def test_messages_schema_without_instance_is_400_naming_its_field(anthropic_sdk, param, name):
    with pytest.raises(anthropic.BadRequestError) as refused:
        MESSAGES_FIELDS[param](anthropic_sdk, NO_INSTANCE[name])
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize("param", MESSAGES_FIELDS)
def test_messages_satisfiable_recursive_schema_still_works(anthropic_sdk, param):
    message = MESSAGES_FIELDS[param](anthropic_sdk, LINKED_LIST)
    if param == "tools[0].input_schema":
        assert message.stop_reason == "tool_use"
        document = message.content[-1].input
    else:
        assert message.stop_reason == "end_turn"
        document = json.loads(message.content[-1].text)
    jsonschema.validate(document, LINKED_LIST)


def test_grammar_no_token_can_begin_is_400_from_the_engine(stories_sdk):
    # The gateway does not read grammars: the engine finds that its compiled grammar allows no first token.
    with pytest.raises(openai.BadRequestError) as refused:
        stories_sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            extra_body={"structured_outputs": {"grammar": "root ::= root"}},
        )
    assert refused.value.param == "structured_outputs.grammar"
    assert "admits no output: no token can begin it" in refused.value.body["message"]


@pytest.mark.parametrize("name", ["ref_to_root", "ref_cycle", "required_self"])
def test_engine_refuses_them_over_grpc_naming_its_field(stories_engine, name):
    sampling = engine_pb2.SamplingParams(max_tokens=8, json_schema=json.dumps(NO_INSTANCE[name]))
    request = engine_pb2.GenerateRequest(request_id=f"no-instance-{name}", text=PROMPT, sampling=sampling)
    with grpc.insecure_channel(stories_engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=60))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("sampling.json_schema: ")
        load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    assert load.running_requests == 0 and load.waiting_requests == 0 and load.kv_blocks_used == 0


@pytest.mark.parametrize("param", FIELDS)
def test_satisfiable_recursive_schema_still_generates_valid_documents(stories_sdk, param):
    response = FIELDS[param](stories_sdk, LINKED_LIST)
    if param == "text.format.schema":
        finish, text = response.status, response.output_text
        assert finish == "completed"
    elif param == "tools[0].function.parameters":
        (call,) = response.choices[0].message.tool_calls
        finish, text = response.choices[0].finish_reason, call.function.arguments
        assert finish == "tool_calls"
    else:
        choice = response.choices[0]
        text = choice.message.content if param.startswith("response_format") else choice.text
        assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(text), LINKED_LIST)
