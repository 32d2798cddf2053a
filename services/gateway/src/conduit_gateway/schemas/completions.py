"""Legacy completions: the request, the response (also the streamed chunk's shape) and its logprobs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from conduit_gateway.schemas.common import PromptLogprobs, SamplingRequest, Usage
from conduit_gateway.schemas.structured import StructuredRequest


class CompletionRequest(SamplingRequest, StructuredRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    logprobs: int | None = Field(
        None, description="Logprobs of the chosen token plus this many alternatives."
    )
    echo: bool | None = Field(None, description="Prepend the prompt to the text (string prompts only).")
    best_of: int | None = Field(None, description="Only accepted when equal to n.")
    suffix: str | None = Field(None, description="Not supported: a non-empty suffix is refused.")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="Only with the prompt_logprobs extra.")


class Completion(BaseModel):
    """A completion; streamed chunks have the same shape with the text so far split across them."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
