"""The Responses API request (POST /v1/responses) and the query of its listing endpoint.

Items and tools are kept loose here (any `type`, extra keys allowed) so that the handler refuses what
it does not support with a 400 naming the item (`input[2].type`), not with an unrelated "extra" error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conduit_gateway.schemas.common import SamplingRequest, StrictModel


class ContentPartParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class InputItemParam(BaseModel):
    """One input item: a message (with or without `type`), a function call or its output, reasoning."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None
    id: str | None = None
    role: str | None = None
    content: str | list[ContentPartParam] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPartParam] | None = None
    status: str | None = None


class ToolParam(BaseModel):
    """A tool; only `type: "function"` is served (other types get a 400 naming them)."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None


class TextFormatParam(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextParam(StrictModel):
    format: TextFormatParam | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningParam(StrictModel):
    effort: str | None = Field(None, description="Accepted; the model reasons as it was trained to.")
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = Field(None, description="Accepted; events are never padded.")


class ResponsesRequest(SamplingRequest):
    """OpenAI's fields, plus the vLLM-style sampling extras of chat (seed, top_k, ignore_eos, ...)."""

    input: str | list[InputItemParam] | None = None
    instructions: str | None = Field(None, description="A system message ahead of the input (not chained).")
    max_output_tokens: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    store: bool | None = Field(
        None, description="Keep the response for retrieve and chaining (default true)."
    )
    previous_response_id: str | None = None
    background: bool | None = None
    stream_options: ResponsesStreamOptions | None = None  # type: ignore[assignment]
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # Accepted hints with no effect on this server.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None
    # OpenAI features this server does not have: any non-null value is refused with 400.
    prompt: Any | None = None
    conversation: Any | None = None
