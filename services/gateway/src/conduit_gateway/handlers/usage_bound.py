"""What a request may use of its key's tokens, prompt by prompt: its worst case, reserved before it runs,
and what it is charged when it ends.

A prompt's worst case is its tokens plus n × max_tokens; without max_tokens a choice may run to the end
of the context (max_model_len − prompt), so n × max_model_len bounds it before the prompt is counted. A
prompt's tokens are known exactly once the engine has counted them (its stream's first message); before
that only a prompt given as token ids is counted.

When the request ends, a prompt whose every choice finished is charged what its usage says. So is a prompt
the client left running: handlers/drain.py aborts it on its engine and reads its stream to the end, whose
last message carries the engine's final usage (`ended`), so every token the engine generated is charged
and no more. A prompt whose stream opened but did not end that way (an engine error, a stream that could
not move, an Abort that failed or a drain that timed out) is charged its worst case: the engine may have
generated tokens the gateway never read. A prompt whose stream never opened generated nothing the engine
reported, and is charged nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.choices import UsageTotals


@dataclass(slots=True)
class _Prompt:
    max_tokens: int | None  # None: to the end of the context
    prompt_tokens: int  # exact once opened; the token ids given, or 0, before
    opened: bool = False
    finished_choices: int = 0


class TokenBound:
    """The per-prompt bounds of one request with `n` choices per prompt."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.context_length: int | None = None
        self._prompts: list[_Prompt] = []

    def plan(self, requests: Sequence[engine_pb2.GenerateRequest], context_length: int | None) -> None:
        """The request's prompts, before they run; `context_length`: the model's, None if unknown."""
        self.context_length = context_length
        self._prompts = [
            _Prompt(
                request.sampling.max_tokens if request.sampling.HasField("max_tokens") else None,
                len(request.token_ids.ids) if request.WhichOneof("input") == "token_ids" else 0,
            )
            for request in requests
        ]

    def worst(self) -> int:
        """The request's worst case in tokens, from what is known now (each opened prompt exactly)."""
        return sum(self._worst(prompt) for prompt in self._prompts)

    def opened(self, prompt_index: int, prompt_tokens: int) -> None:
        prompt = self._prompts[prompt_index]
        prompt.opened = True
        prompt.prompt_tokens = prompt_tokens

    def finished(self, prompt_index: int) -> None:
        """One choice of the prompt finished (an output's ending, not an engine failure)."""
        self._prompts[prompt_index].finished_choices += 1

    def done(self, prompt_index: int) -> bool:
        """Whether every choice of the prompt has finished."""
        return self._prompts[prompt_index].finished_choices >= self.n

    def ended(self, prompt_index: int) -> None:
        """The prompt's stream was read to its end after an Abort (handlers/drain.py): its usage is the
        engine's final count, so it is charged that."""
        self._prompts[prompt_index].finished_choices = self.n

    @property
    def prompts(self) -> int:
        return len(self._prompts)

    def used(self, usage: UsageTotals | None) -> int:
        """What the request is charged at its end (see the module docstring)."""
        total = 0
        for index, prompt in enumerate(self._prompts):
            if not prompt.opened:
                continue
            reported = usage.total_of(index) if usage is not None else prompt.prompt_tokens
            if prompt.finished_choices >= self.n:
                total += reported
            else:
                total += max(reported, self._worst(prompt))
        return total

    def _worst(self, prompt: _Prompt) -> int:
        if prompt.max_tokens is not None:
            return prompt.prompt_tokens + self.n * prompt.max_tokens
        if self.context_length is None:
            return prompt.prompt_tokens  # nothing bounds the output here; the engine's length will
        if not prompt.opened:
            return self.n * self.context_length  # >= p + n (L - p) for any prompt length p
        return prompt.prompt_tokens + self.n * max(0, self.context_length - prompt.prompt_tokens)
