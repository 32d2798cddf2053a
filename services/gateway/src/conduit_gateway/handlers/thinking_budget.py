"""A reasoning budget kept by the gateway: `thinking.budget_tokens` of the Messages API with a reasoning
parser, without any engine support beyond token-id prompts.

The request runs in two parts that the client reads as one stream:
1. The reasoning: at most `budget` tokens, stopping at the reasoning parser's end tag (kept in the text).
   No structure applies here; the client's stop sequences do.
2. The answer: a continuation whose prompt is the prompt's token ids plus every token of part 1 (plus the
   end tag's tokens when the budget ran out before the model closed its reasoning: the gateway closes it),
   with the request's own sampling: what is left of max_tokens, its stop sequences, and its structure
   (output format or forced tool calls) from the first answer token.
Usage reads as one request: part 1's prompt and cached tokens, output tokens of both parts (the end tag
the gateway added counts as output). Part 1 ending any other way (EOS, a stop sequence, the context full)
ends the whole request there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.streams import EngineStream

# Opens part 2 from its request (the handler's stream opener for prompt 0).
OpenContinuation = Callable[[engine_pb2.GenerateRequest], Awaitable[EngineStream]]
# The end tag's token ids (the engine's Tokenize of its text, without special tokens).
EndTagIds = Callable[[], Awaitable[list[int]]]


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    budget: int
    end_tag: str

    def reasoning_sampling(self, answer: engine_pb2.SamplingParams) -> engine_pb2.SamplingParams:
        """Part 1's sampling from the request's (part 2's): free text, `budget` tokens, until the end tag."""
        params = engine_pb2.SamplingParams()
        params.CopyFrom(answer)
        params.ClearField("structured")
        params.ClearField("structured_after")
        params.ClearField("structured_any_whitespace")
        params.max_tokens = min(self.budget, answer.max_tokens)
        params.stop.append(self.end_tag)
        params.include_stop_str_in_output = True  # the reasoning parser must see the end tag
        return params


class BudgetedStream:
    """Part 1's stream, then part 2's, read as one EngineStream."""

    def __init__(
        self,
        reasoning: EngineStream,
        request: engine_pb2.GenerateRequest,
        budget: ThinkingBudget,
        open_continuation: OpenContinuation,
        end_tag_ids: EndTagIds,
    ) -> None:
        self.prompt_index = reasoning.prompt_index
        self._stream = reasoning
        self._request = request  # part 2's request as the handler built it (its sampling, no input yet)
        self._budget = budget
        self._open_continuation = open_continuation
        self._end_tag_ids = end_tag_ids
        self._prompt_ids = list(reasoning.first.prompt_token_ids)
        self._output_ids: list[int] = []
        self._reasoning_usage = engine_pb2.Usage()
        self._added: list[int] = []  # the end tag's tokens, when the gateway closed the reasoning
        self._next_part: bool | None = None  # part 1 ended: open part 2 (True: close the reasoning first)
        self._queued: list[engine_pb2.GenerateResponse] = []
        self._answering = False
        self._tail = ""  # the end of part 1's text, as long as the end tag
        self._aborted = False  # stopped on purpose: part 2 does not open
        self.token_gaps = None
        self.first = self._from_reasoning(reasoning.first)

    async def read(self) -> engine_pb2.GenerateResponse | None:
        if self._queued:
            return self._queued.pop(0)
        if self._next_part is not None:
            if self._aborted:
                return None
            await self._continue(close_reasoning=self._next_part)
            self._next_part = None
            return self._queued.pop(0)
        message = await self._stream.read()
        if message is None:
            return None
        return self._from_answer(message) if self._answering else self._from_reasoning(message)

    def ready(self) -> list[engine_pb2.GenerateResponse]:
        return []  # each message is read through the budget's checks

    async def abort(self) -> None:
        self._aborted = True
        await self._stream.abort()

    def close(self) -> None:
        self._stream.close()

    def _from_reasoning(self, message: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        self._output_ids.extend(message.token_ids)
        self._reasoning_usage = message.usage
        self._tail = (self._tail + message.text)[-len(self._budget.end_tag) :]
        if not message.finished:
            return message
        stop = message.stop_string if message.HasField("stop_string") else None
        spent = (
            message.finish_reason == engine_pb2.FINISH_REASON_LENGTH
            and message.usage.completion_tokens >= self._budget.budget
            and self._budget.budget < self._request.sampling.max_tokens
        )
        # The end tag as the budget's last token may be reported as the budget's length.
        closed = stop == self._budget.end_tag or (spent and self._tail == self._budget.end_tag)
        if not (closed or spent):
            if stop is not None and message.text.endswith(stop):
                # Part 1 keeps stop strings in its text for the end tag's sake; a client's never shows.
                message.text = message.text[: len(message.text) - len(stop)]
            return message
        message.finished = False
        message.finish_reason = engine_pb2.FINISH_REASON_UNSPECIFIED
        message.ClearField("stop_string")
        message.ClearField("stop_token_id")
        self._next_part = not closed
        return message

    async def _continue(self, close_reasoning: bool) -> None:
        """Close the reasoning if the budget ran out before the model did, then open part 2."""
        if close_reasoning:
            self._added = list(await self._end_tag_ids())
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        request.request_id = f"{self._request.request_id}-answer"
        del request.token_ids.ids[:]  # the prompt is token ids now (the chat input goes)
        request.token_ids.ids.extend(self._prompt_ids + self._output_ids + self._added)
        used = self._reasoning_usage.completion_tokens + len(self._added)
        request.sampling.max_tokens = max(1, self._request.sampling.max_tokens - used)
        self._stream.close()
        self._stream = await self._open_continuation(request)
        self._answering = True
        if self._added:
            # The end tag the gateway wrote, as if the model had: the reasoning parser splits there.
            closing = engine_pb2.GenerateResponse(
                request_id=self._stream.first.request_id, text=self._budget.end_tag, token_ids=self._added
            )
            closing.usage.CopyFrom(self._usage(0))
            self._queued.append(closing)
        self._queued.append(self._from_answer(self._stream.first))

    def _from_answer(self, message: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        message.usage.CopyFrom(self._usage(message.usage.completion_tokens))
        return message

    def _usage(self, answer_tokens: int) -> engine_pb2.Usage:
        return engine_pb2.Usage(
            prompt_tokens=self._reasoning_usage.prompt_tokens,
            cached_tokens=self._reasoning_usage.cached_tokens,
            completion_tokens=self._reasoning_usage.completion_tokens + len(self._added) + answer_tokens,
        )
