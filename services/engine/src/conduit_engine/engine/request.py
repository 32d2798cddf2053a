"""What a caller submits (`GenerationRequest`) and what the engine streams back (`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.continuation import Continuation
from conduit_engine.kv_transfer.params import KvConsume
from conduit_engine.kv_transfer.registry import KvTransfer
from conduit_engine.models.tokenizer import ChatMessage
from conduit_engine.sampling.token_logprobs import TokenLogprobs
from conduit_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerationRequest:
    """Exactly one of text, token_ids or messages is the prompt."""

    request_id: str
    params: SamplingParams
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # with messages: given to the chat template as `tools`
    documents: list[Any] | None = None  # with messages: given to the chat template as `documents`
    priority: int = 0
    arrival_time: float | None = None  # observer.clock() at arrival; None: when the engine admits it
    # Opaque to the engine: the caller's tracing context (an OpenTelemetry Context), handed back to the
    # observers in the request's RequestRecord so its spans join the caller's trace. None: not traced.
    trace_context: object | None = None
    # Disaggregation (at most one): run only the prefill side and hand the KV off, or only the decode side.
    kv_produce: bool = False
    kv_consume: KvConsume | None = None
    # Migration: the choices another engine started, continued here from their tokens so far.
    continuation: Continuation | None = None
    lora: str | None = None  # the LoRA adapter it runs (the request's model names it); None: the base model

    @property
    def num_choices(self) -> int:
        """Choices this engine runs: all n, on the decode side those the prefill left running, and for a
        continuation those it continues."""
        if self.kv_consume is not None:
            return len(self.kv_consume.first_tokens)
        if self.continuation is not None:
            return len(self.continuation.choices)
        return self.params.n


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one choice since the previous output of that choice."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    usage: Usage
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None
    prompt_token_ids: list[int] | None = None  # on the first output of the request
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first output, when asked for
    error: str | None = None  # with FinishReason.ERROR: what failed (a message, never a traceback)
    kv_transfer: KvTransfer | None = None  # with FinishReason.KV_HANDOFF: the KV a decode engine pulls

    def merged_with(self, later: RequestOutput) -> RequestOutput:
        """This output followed by `later`, the next output of the same choice, as one output: what a
        reader that fell behind the engine receives (fewer, larger messages; nothing lost or reordered)."""
        return RequestOutput(
            request_id=self.request_id,
            index=self.index,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            usage=later.usage,
            logprobs=self.logprobs + later.logprobs,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_string=later.stop_string,
            stop_token_id=later.stop_token_id,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            error=later.error,
            kv_transfer=later.kv_transfer,
        )
