"""Anthropic's Messages API: the request of POST /v1/messages (and of /v1/messages/count_tokens), the
Message it answers and the streamed events, with the field names of Anthropic's API reference.

Content blocks are read loosely (any `type`, extra keys allowed) so that the handler can refuse a block
it does not support (image, document, ...) with a 400 naming it, rather than a schema error about an
unrelated key; the top-level request is strict, as Anthropic's is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conduit_gateway.schemas.common import StrictModel


class ContentBlockParam(BaseModel):
    """One block of a message's content: text, tool_use, tool_result, thinking, redacted_thinking."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[ContentBlockParam] | None = None
    is_error: bool | None = None
    # thinking / redacted_thinking (given back as received; not shown to the chat template)
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: dict[str, Any] | None = Field(None, description="Accepted and ignored.")


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class SystemBlockParam(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    citations: Any | None = None


class ToolParam(BaseModel):
    """A client tool; server tools (a `type` such as web_search_20250305) are refused by the handler."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = Field(None, description='"custom" or absent.')
    cache_control: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    strict: bool | None = Field(None, description="Accepted; forced calls always match input_schema.")


class ToolChoiceParam(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description='The tool to call, with type "tool".')
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(StrictModel):
    type: Literal["enabled", "adaptive", "disabled", "between_tools"]
    budget_tokens: int | None = Field(
        None, strict=True, description='Most reasoning tokens, with type "enabled".'
    )
    display: Literal["summarized", "omitted"] | None = None


class OutputFormatParam(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON schema the answer follows.")


class OutputConfigParam(StrictModel):
    format: OutputFormatParam | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(None, description="Accepted.")


class MetadataParam(StrictModel):
    user_id: str | None = Field(None, description="Logged with the request id.")


class MessageInputs(StrictModel):
    """What count_tokens takes: the fields that make the prompt."""

    model: str = Field(description="Served model name, as listed by GET /v1/models.")
    messages: list[MessageParam]
    system: str | list[SystemBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None
    cache_control: dict[str, Any] | None = Field(None, description="Accepted and ignored.")

    # The attributes the shared generation flow reads, which this API does not have.
    @property
    def n(self) -> None:
        return None

    @property
    def stream_options(self) -> None:
        return None

    @property
    def prompt_logprobs(self) -> None:
        return None

    @property
    def priority(self) -> None:
        return None


class MessagesRequest(MessageInputs):
    # strict: true is not 1 here, as on Anthropic's API.
    max_tokens: int = Field(strict=True, description="Most tokens to generate (required).")
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    # The anthropic SDK 2.x no longer sends these three; older clients and extra_body do.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, strict=True)
    metadata: MetadataParam | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="Accepted.")
    inference_geo: str | None = Field(None, description="Accepted.")
    speed: Literal["standard", "fast"] | None = Field(None, description="Accepted.")

    @property
    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata is not None else None


# -- responses -------------------------------------------------------------------------------------


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = Field(0, description="Prompt tokens the engine's prefix cache held.")


class Message(BaseModel):
    id: str = Field(description="msg_...")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(description="text, thinking and tool_use blocks.")
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


class MessageTokensCount(BaseModel):
    input_tokens: int = Field(description="Equal to usage.input_tokens of the same request.")


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
    request_id: str | None = None
