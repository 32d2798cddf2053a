"""Chat completions: the request, the response and the streamed chunk."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conduit_gateway.schemas.common import PromptLogprobs, SamplingRequest, StrictModel, Usage


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
    reasoning_content: str | None = None


class ResponseFormat(StrictModel):
    type: str = Field(description='Only "text" is supported.')
    json_schema: Any | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = Field(None, description="Same as max_tokens (its newer name).")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = Field(None, description="Append the assistant turn opener.")
    # Accepted hints with no effect on a single-tenant server without storage.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # OpenAI features this server does not have: any non-null value is refused with 400.
    tools: Any | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: Any | None = None
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


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
