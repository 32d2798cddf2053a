"""Chat completions: the request, the response and the streamed chunk."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conduit_gateway.schemas.common import PromptLogprobs, SamplingRequest, StrictModel, Usage
from conduit_gateway.schemas.structured import NamedToolChoice, StructuredRequest, ToolDefinition


class ContentPart(BaseModel):
    """One part of a message's content; only "text" parts are supported (others get a 400)."""

    # Other part kinds (image_url, input_audio, file) carry their own keys: let them through to the
    # mapper, which refuses them naming the part, rather than failing with an unrelated "extra" error.
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ToolCallFunction(StrictModel):
    name: str
    arguments: str


class ToolCallParam(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageParam(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    # Present when a client sends back a message object it received; only null is accepted.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any | None = None
    function_call: Any | None = None
    # Reasoning of an earlier reply, sent back as received; not given to the template.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingRequest, StructuredRequest):
    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = Field(None, description="Same as max_tokens (its newer name).")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = Field(None, description="Append the assistant turn opener.")
    # Accepted hints with no effect on a single-tenant server without storage.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default "auto" with tools (needs --tool-call-parser), else "none".'
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Allow several calls in one reply (default true)."
    )
    # OpenAI features this server does not have: any non-null value is refused with 400.
    functions: Any | None = None
    function_call: Any | None = None
    audio: Any | None = None
    modalities: Any | None = None
    prediction: Any | None = None
    reasoning_effort: Any | None = None
    web_search_options: Any | None = None
    verbosity: Any | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None
    refusal: list[TokenLogprobEntry] | None = None


def _absent_when_none(value: object) -> bool:
    return value is None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text, exactly as the model wrote them.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    # Absent (not null) unless there is something to say, as OpenAI shapes its messages.
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent_when_none)
    reasoning_content: str | None = Field(
        None, exclude_if=_absent_when_none, description="With --reasoning-parser: the reasoning text."
    )
    reasoning: str | None = Field(
        None, exclude_if=_absent_when_none, description="Same as reasoning_content."
    )


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="Only with the prompt_logprobs extra.")


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, description="In the call's first delta only.")
    arguments: str | None = Field(None, description="The next fragment of the arguments text.")


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = Field(None, description="In the call's first delta only.")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """Documents the SSE `data:` objects of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
