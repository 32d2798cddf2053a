"""Shapes shared by chat and completions: the sampling fields, stream options, usage and error bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """Unknown fields are refused (never silently ignored) and floats must be finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = Field(None, description="Send a last chunk with the request's usage.")
    continuous_usage_stats: bool | None = Field(None, description="Carry running usage in every chunk.")


class SamplingRequest(StrictModel):
    """Fields every generation request has: model, streaming, and the engine's sampling set."""

    model: str = Field(description="Served model name, as listed by GET /v1/models.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, description="Most tokens to generate per choice.")
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(None, description="Completions per prompt.")
    seed: int | None = Field(None, description="Same seed, same tokens (any int64; taken modulo 2**64).")
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) → bias.")
    user: str | None = Field(None, description="End-user id; logged with the request id.")
    # vLLM-style extras, accepted at the top level.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = Field(None, description="Lower runs first (default 0).")
    prompt_logprobs: int | None = Field(
        None, description="Logprobs of the prompt tokens with this many alternatives (not with stream)."
    )


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# Per prompt position: None for the first token, else token id (as a string) → its logprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting the OpenAI error body for each status."""
    return {status: {"model": ErrorResponse} for status in statuses}
