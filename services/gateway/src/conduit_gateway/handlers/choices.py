"""Per-request accumulation state: each choice's text, logprobs and finish reason, and the usage totals."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.sse import json_string

FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}

# Engine endings that are not an output: the error each one becomes. A stream the engine hands back at the
# end of its drain (MIGRATE) ends as an engine gone mid-stream does, never as a short "stop".
_ENGINE_ENDINGS = {
    engine_pb2.FINISH_REASON_ERROR: (500, "failed", "engine_error"),
    engine_pb2.FINISH_REASON_MIGRATE: (503, "shut down", "engine_unavailable"),
}


def ending_error(finish_reason: int, index: int) -> OpenAIError | None:
    """The error a choice's engine ending is for the client (None for an output's ending)."""
    ending = _ENGINE_ENDINGS.get(finish_reason)
    if ending is None:
        return None
    status, what, code = ending
    return OpenAIError(
        status, f"The engine {what} while generating choice {index}.", type="server_error", code=code
    )


# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor instead.
LOGPROB_FLOOR = -9999.0


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


# Token text -> its JSON string and its UTF-8 bytes as a JSON array's items, as logprobs write them for
# every token and alternative. The texts are the model's vocabulary, so most repeat; the cache is
# emptied when it reaches TOKEN_TEXTS_MAX entries (a stream of unusual texts cannot grow it further).
_TOKEN_TEXTS: dict[str, tuple[str, str]] = {}
TOKEN_TEXTS_MAX = 1 << 16


def token_text_json(text: str) -> tuple[str, str]:
    """(`json_string(text)`, the comma-separated bytes of `text` in UTF-8)."""
    parts = _TOKEN_TEXTS.get(text)
    if parts is None:
        if len(_TOKEN_TEXTS) >= TOKEN_TEXTS_MAX:
            _TOKEN_TEXTS.clear()
        parts = _TOKEN_TEXTS[text] = (json_string(text), ",".join(map(str, text.encode("utf-8"))))
    return parts


@dataclass(slots=True)
class ChoiceState:
    """One choice (index = prompt_index * n + engine index) as it is being built."""

    index: int
    # Text a completion echoes before the generated text (the prompt, when `echo` is set).
    prefix: str = ""
    prefix_sent: bool = False
    texts: list[str] = field(default_factory=list)
    logprobs: list[engine_pb2.PositionLogprobs] = field(default_factory=list)
    # Character offset of each logprobs position in the choice's text (completions' text_offset).
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Characters sent so far (the start of the next token's text_offset in completions logprobs; counted
    # only where logprobs are asked for).
    chars: int = 0

    def text(self) -> str:
        return self.prefix + "".join(self.texts)

    def add(self, message: engine_pb2.GenerateResponse) -> None:
        """Accumulate one engine message (non-streamed responses)."""
        start = len(self.prefix) + sum(len(text) for text in self.texts) if message.logprobs else 0
        self.offsets.extend(token_offsets(start, message.text, message.logprobs))
        if message.text:
            self.texts.append(message.text)
        self.logprobs.extend(message.logprobs)


def token_offsets(start: int, text: str, logprobs: Sequence[engine_pb2.PositionLogprobs]) -> list[int]:
    """Where each token of one message starts in the choice's text.

    Measured on the text actually sent, not on the tokens' own texts: a token decoded alone can differ
    from its share of the text (SentencePiece drops the leading space of "▁there").
    """
    offsets = []
    within = 0
    for position in logprobs:
        offsets.append(start + min(within, len(text)))
        within += len(position.token.text)
    return offsets


def prompt_logprobs_entries(positions: Sequence[engine_pb2.PositionLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` layout: None for the first prompt token (nothing predicts it), then per
    position {token id: {logprob, rank, decoded_token}} for the prompt token and its top alternatives."""
    entries: list[dict[str, Any] | None] = [None]
    for position in positions:
        entry = {}
        for candidate in (position.token, *position.top):
            entry[str(candidate.token_id)] = {
                "logprob": safe_logprob(candidate.logprob),
                "rank": candidate.rank,
                "decoded_token": candidate.text,
            }
        entries.append(entry)
    return entries


class ChoiceSet:
    """The choices of one request, made when the engine first streams them.

    Made lazily (not prompts × n up front) so memory follows what the engine actually sends.
    """

    def __init__(self, n: int, make: Callable[[int, int], ChoiceState]) -> None:
        self.n = n
        self._make = make  # (choice index, prompt index) → new state
        self._by_index: dict[int, ChoiceState] = {}

    def get(self, prompt_index: int, engine_index: int) -> tuple[ChoiceState, bool]:
        """The choice and whether it was just made; the caller has checked engine_index < n."""
        index = prompt_index * self.n + engine_index
        choice = self._by_index.get(index)
        if choice is not None:
            return choice, False
        choice = self._by_index[index] = self._make(index, prompt_index)
        return choice, True

    def made(self, prompt_index: int, engine_index: int) -> ChoiceState | None:
        """The choice if it has been made, without making it."""
        return self._by_index.get(prompt_index * self.n + engine_index)

    def ordered(self) -> list[ChoiceState]:
        return [self._by_index[index] for index in sorted(self._by_index)]


class UsageTotals:
    """The latest running usage of each prompt's stream, summed over prompts."""

    def __init__(self, prompts: int) -> None:
        self._latest = [engine_pb2.Usage() for _ in range(prompts)]

    def update(self, prompt_index: int, usage: engine_pb2.Usage) -> None:
        # The engine's usage is running and request-wide (all choices), so the newest message wins.
        self._latest[prompt_index] = usage

    def update_from(self, prompt_index: int, message: engine_pb2.GenerateResponse) -> None:
        """`update` with `message`'s usage."""
        self._latest[prompt_index] = message.usage

    @property
    def total_tokens(self) -> int:
        """prompt_tokens + completion_tokens."""
        latest = self._latest
        if len(latest) == 1:
            return latest[0].prompt_tokens + latest[0].completion_tokens
        return sum(usage.prompt_tokens + usage.completion_tokens for usage in latest)

    @property
    def completion_tokens(self) -> int:
        return sum(usage.completion_tokens for usage in self._latest)

    def total_of(self, prompt_index: int) -> int:
        """Prompt + completion tokens of one prompt's stream, as last reported."""
        usage = self._latest[prompt_index]
        return usage.prompt_tokens + usage.completion_tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(usage.prompt_tokens for usage in self._latest)

    def as_dict(self) -> dict[str, Any]:
        prompt = self.prompt_tokens
        completion = self.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(usage.cached_tokens for usage in self._latest)},
        }
