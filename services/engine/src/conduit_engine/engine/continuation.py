"""Continuing choices another engine started (request migration): the checks of a request's continuation
and the replay of its tokens as output.

Plain Python: no torch. A continued choice's tokens go through the engine's token update one by one
(`accept`: grammar, stop rules, detokenizer), exactly as if they had been sampled here, so max_tokens,
min_tokens, the penalties, stop strings (a partial match held back included), the grammar and the seeded
draw counter go on from where the other engine was. The text the replay releases is the text the client
already has; it must equal the continuation's, and it is not sent again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conduit_engine.core.sequence import FinishReason, Sequence
from conduit_engine.errors import InvalidRequestError

_FIELD = "continuation.choices"


@dataclass(frozen=True, slots=True)
class ContinuedChoice:
    """One choice's output so far: its tokens and the text its client received for them."""

    index: int
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class Continuation:
    """The choices of a request that continue here, by index."""

    choices: tuple[ContinuedChoice, ...]

    @property
    def choice_indices(self) -> list[int]:
        return [choice.index for choice in self.choices]


def check_continuation(continuation: Continuation, n: int, vocab_size: int) -> None:
    """Raise InvalidRequestError naming the field unless every continued choice exists once and its tokens
    lie inside the vocabulary (`n`: the admitted request's)."""
    if not continuation.choices:
        raise InvalidRequestError(_FIELD, "must continue at least one choice")
    seen: set[int] = set()
    for i, choice in enumerate(continuation.choices):
        if choice.index >= n:
            raise InvalidRequestError(
                f"{_FIELD}[{i}].index", f"choice index {choice.index} is not below n ({n})"
            )
        if choice.index in seen:
            raise InvalidRequestError(f"{_FIELD}[{i}].index", f"choice {choice.index} is continued twice")
        seen.add(choice.index)
        bad = next((t for t in choice.token_ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{_FIELD}[{i}].token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
            )


def replay_continuation(
    continuation: Continuation, seqs: list[Sequence], accept: Callable[[Sequence, int], str]
) -> None:
    """Append each continued choice's tokens to its sequence through `accept` (the engine's token update,
    returning the text it releases). Raises InvalidRequestError for tokens that would have ended their
    choice or that its grammar refuses, and for a text other than the one those tokens release."""
    for i, (seq, choice) in enumerate(zip(seqs, continuation.choices, strict=True)):
        released = ""
        for position, token_id in enumerate(choice.token_ids):
            released += accept(seq, token_id)
            if seq.is_finished:
                why = (
                    "is not allowed by the request's output structure"
                    if seq.finish_reason is FinishReason.ERROR
                    else "ends the choice by its stop rules (an engine ends such a choice itself)"
                )
                raise InvalidRequestError(
                    f"{_FIELD}[{i}].token_ids", f"token {token_id} at position {position} {why}"
                )
        if released != choice.text:
            raise InvalidRequestError(
                f"{_FIELD}[{i}].text",
                f"is not the text its tokens release ({len(choice.text)} characters given, "
                f"{len(released)} released)",
            )
