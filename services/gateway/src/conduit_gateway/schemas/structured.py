"""Request fields that constrain the output's structure: OpenAI's `response_format` and vLLM's
`structured_outputs` and older `guided_*` extras (both APIs take them), and chat's tool definitions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from conduit_gateway.schemas.common import StrictModel


class JsonSchemaFormat(StrictModel):
    # `schema` and `json` shadow pydantic's BaseModel methods: the attributes are aliased.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(description="Name of the schema (required by OpenAI; not used for decoding).")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="The JSON Schema.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced exactly.")


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: at most one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_value: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON Schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF in xgrammar's dialect (`root ::= ...`).")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(
        None, description="JSON outputs: no free whitespace between tokens (the default here)."
    )


class StructuredRequest(StrictModel):
    """The structured-output fields of a generation request (chat and completions)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = Field(
        None, description="Not supported (use structured_outputs.disable_any_whitespace)."
    )


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments.")
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction
