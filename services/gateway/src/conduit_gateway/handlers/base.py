"""The flow every generation request follows: validate → map to the proto → open the engine streams →
stream SSE events or accumulate one response. Subclasses only map requests and shape choices."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar, Literal

import grpc
from opentelemetry import trace
from pydantic import BaseModel
from starlette.responses import Response

from conduit.engine.v1 import engine_pb2
from conduit_common import tracing
from conduit_gateway.context import GatewayContext
from conduit_gateway.errors import OpenAIError, from_rpc_error, invalid_param, too_many_requests
from conduit_gateway.handlers import fields
from conduit_gateway.handlers.choices import (
    FINISH_REASONS,
    ChoiceSet,
    ChoiceState,
    UsageTotals,
    ending_error,
    prompt_logprobs_entries,
)
from conduit_gateway.handlers.chunk_push import ChunkPush, TextEvents
from conduit_gateway.handlers.coalesce import merge_batch
from conduit_gateway.handlers.disaggregated import continuation_opener, stream_opener
from conduit_gateway.handlers.drain import drain_later
from conduit_gateway.handlers.migration import Migration, Migrations, migrating
from conduit_gateway.handlers.streams import (
    EngineStream,
    OpenOne,
    PromptStream,
    Unread,
    close_all,
    open_streams,
    read_batches,
    read_messages,
)
from conduit_gateway.handlers.usage_bound import TokenBound
from conduit_gateway.http.sse import (
    DONE_EVENT,
    ChunkEncoder,
    ClientPace,
    EventStreamResponse,
    RawJson,
    error_event,
)
from conduit_gateway.keys.keys_file import ApiKey
from conduit_gateway.keys.priority import allowed_priority
from conduit_gateway.keys.rate_limit import TokenReservation
from conduit_gateway.prompt_limits import PromptLimit, prompt_limit
from conduit_gateway.schemas.common import SamplingRequest, Usage
from conduit_gateway.structured.constraints import Constraint

log = logging.getLogger(__name__)

# The request fields that hold prompt text, logged only with --log-prompts.
_PROMPT_FIELDS = {"prompt", "messages", "suffix", "input", "instructions"}


class GenerationHandler(ABC):
    """Serves one request: validation, admission against the key's limits, the engine streams, usage, errors
    and logs. Subclasses map their API's body onto engine requests (`build_inputs`, `build_sampling`,
    `param_aliases`) and write the answer in `handle`: chat, completions and messages through
    `ChunkedHandler`'s chunk hooks, responses through its own event writer."""

    endpoint: ClassVar[str]  # metrics label
    id_prefix: ClassVar[str]  # "chatcmpl" / "cmpl"
    chunk_object: ClassVar[str]  # `object` of streamed chunks
    # model_dump `exclude` dropping the response's prompt_logprobs field(s) when they were not asked for.
    absent_prompt_logprobs: ClassVar[dict[str, Any]]

    def __init__(
        self, ctx: GatewayContext, body: SamplingRequest, request_id: str, api_key: ApiKey | None = None
    ) -> None:
        self.ctx = ctx
        # The caller's key (None: no keys configured) and, once admitted, the tokens it holds of the key's.
        self.api_key = api_key
        self.reservation: TokenReservation | None = None
        # What the request may use, per prompt (handlers/usage_bound.py), and what it has used.
        self.bound = TokenBound(body.n or 1)
        self.usage: UsageTotals | None = None
        # Messages read from the engine but not yet handled when the client left (counted by the drain).
        self.unread: Unread = []
        # Whether a reader ended or failed and closed the streams; if not, the client left: they are drained.
        self._streams_read = False
        # The prompts' streams that had opened when the client left while the others were opening.
        self._left_open: list[EngineStream] = []
        # The prompts whose opening the client left, finishing in the background (streams.open_stream).
        self._left_opening: list[asyncio.Task[PromptStream | None]] = []
        self.holds_key_slot = False  # a background run holds a concurrent slot of its key
        self.body = body
        self.request_id = request_id
        self.response_id = f"{self.id_prefix}-{request_id}"
        self.created = int(time.time())
        self.n = body.n or 1
        self._started = time.perf_counter()
        # Prompt index → the prompt's logprobs (vLLM's prompt_logprobs extra), from its first message.
        self.prompt_logprobs: dict[int, list[engine_pb2.PositionLogprobs]] = {}
        # The structured-output constraint build_sampling set, if any (engine errors about it name it).
        self.constraint: Constraint | None = None
        self._stream_opener: OpenOne | None = None
        # The request's span (the SERVER span with tracing on), for events after the handler returns.
        self._span = trace.get_current_span()

    @abstractmethod
    def build_inputs(self) -> list[engine_pb2.GenerateRequest]:
        """One request per prompt with its `input` set; raise OpenAIError(400) naming a bad field."""

    @abstractmethod
    def build_sampling(self) -> engine_pb2.SamplingParams:
        """The sampling set (shared fields via handlers.sampling, plus the API's own spellings)."""

    @abstractmethod
    def param_aliases(self) -> dict[str, str]:
        """Engine field name → this API's field name, for `param` in errors the engine reports."""

    def new_choice(self, index: int, prompt_index: int) -> ChoiceState:
        """State for a choice the engine just started streaming."""
        return ChoiceState(index)

    def prepared_requests(self) -> list[engine_pb2.GenerateRequest]:
        """The engine requests: the hooks' inputs and sampling set, with ids, model and priority."""
        requests = self.build_inputs()
        limit = prompt_limit(self.ctx.pool, self.body.model)
        if limit is not None:
            self.check_prompt_sizes(limit, requests)
        sampling = self.build_sampling()
        for prompt_index, request in enumerate(requests):
            request.request_id = (
                self.request_id if len(requests) == 1 else f"{self.request_id}-{prompt_index}"
            )
            request.model = self.body.model
            request.sampling.CopyFrom(sampling)
            priority = self._priority()
            if priority is not None:
                request.priority = priority
        return requests

    def _priority(self) -> int | None:
        """The request's `priority`, when its key may set one (keys/priority.py)."""
        if self.body.priority is None:
            return None
        value = fields.int32("priority", self.body.priority)
        return allowed_priority(self.api_key, value, self.ctx.priority_ignored)

    def check_prompt_sizes(self, limit: PromptLimit, requests: list[engine_pb2.GenerateRequest]) -> None:
        """400 for a prompt that cannot fit the model's context, before any engine tokenizes it. A
        handler that still holds its prompts' texts checks those instead (reading a long text back out
        of its protobuf copies it once more)."""
        param = self.param_aliases().get("prompt", "prompt")
        for index, request in enumerate(requests):
            limit.check_generate(param if len(requests) == 1 else f"{param}[{index}]", request)

    def admit(self, requests: list[engine_pb2.GenerateRequest]) -> None:
        """Log the request and reserve its worst case of the key's tokens and a slot of the gateway's
        concurrency (429 when either is short); `_release` gives back the slot and what was not used."""
        self._log_start(len(requests))
        self.bound.plan(requests, self._context_length())
        if self.api_key is not None:
            self.reservation = self.ctx.rate_limiter.reserve(self.api_key, self.bound.worst())
        limiter = self.ctx.limiter
        if not limiter.try_acquire():
            self.ctx.metrics.rejected.inc()
            self._settle()
            raise too_many_requests(
                f"The gateway is serving its limit of {limiter.limit} concurrent requests; retry shortly.",
                self.ctx.config.retry_after_s,
            )
        self.ctx.metrics.generations_in_flight.inc()

    def opened(self, streams: list[EngineStream]) -> None:
        """The engine streams are open: time the first token, watch token gaps, charge the prompts."""
        # Labelled by model only now: the model is served, so clients cannot invent label values.
        metrics = self.ctx.metrics
        metrics.first_token_seconds.labels(self.endpoint, self.body.model).observe(
            time.perf_counter() - self._started
        )
        for stream in streams:
            stream.token_gaps = metrics.inter_token_seconds.labels(self.body.model)

    def _log_start(self, prompts: int) -> None:
        """The request's log line (its prompt text only with --log-prompts) and its span's model."""
        log.info(
            "request %s: %s model=%s prompts=%d n=%d stream=%s user=%s%s",
            self.request_id,
            self.endpoint,
            self.body.model,
            prompts,
            self.n,
            bool(self.body.stream),
            self.body.user,
            f" input={self.body.model_dump_json(include=_PROMPT_FIELDS, exclude_none=True)}"
            if self.ctx.config.log_prompts
            else "",
        )
        trace.get_current_span().set_attribute(tracing.MODEL, self.body.model)

    def _context_length(self) -> int | None:
        """The model's context length (max_model_len), from a node that serves it; None if none is known."""
        node = self.ctx.pool.serving_node(self.body.model)
        info = node.model_info if node is not None else None
        return info.max_model_len if info is not None and info.max_model_len else None

    def _new_usage(self, prompts: int) -> UsageTotals:
        self.usage = UsageTotals(prompts)
        return self.usage

    def _count(self, usage: UsageTotals, prompt_index: int, message: engine_pb2.GenerateResponse) -> None:
        """Take a message's usage into the request's totals and hold that much of the key's tokens."""
        usage.update_from(prompt_index, message)
        reservation = self.reservation
        if reservation is not None:
            tokens = usage.total_tokens
            # The reservation holds the worst case as it stood at its last change (the plan, each prompt
            # opening), so only tokens beyond what it holds can take more.
            if tokens > reservation.taken:
                self._charge(tokens)

    def _charge(self, tokens: int) -> None:
        """The request has used `tokens` (prompt + output) so far: hold at least that of the key's."""
        if self.reservation is not None:
            self.reservation.hold(max(tokens, self.bound.worst()))

    def _stream_opened(self, stream: EngineStream) -> None:
        """A prompt's first message arrived: the engine counted its prompt; the reservation grows by it."""
        self.bound.opened(stream.prompt_index, stream.first.usage.prompt_tokens)
        self._charge(0)

    def _settle(self) -> None:
        """The request has ended: the key is charged what it used (a prompt's stream that did not end, its
        worst case: the engine may have generated tokens the gateway never read; handlers/drain.py reads
        those of a client that left to the end first) and gets the rest of its reservation back."""
        if self.reservation is not None:
            self.reservation.settle(self.bound.used(self.usage))

    def _with_limit_headers(self, response: Response) -> Response:
        """OpenAI's x-ratelimit-* headers of the key, as they stand when the response starts."""
        if self.reservation is not None:
            response.headers.update(self.reservation.headers())
        return response

    @contextlib.contextmanager
    def _reading(self, streams: Sequence[EngineStream]) -> Iterator[None]:
        """Around a reader of `streams`: when it ends or fails they close at once; when it is cancelled
        (the client left) they stay open for `_release`, which drains them (handlers/drain.py)."""
        left = False
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            left = True
            raise
        finally:
            if not left:
                self._read_all(streams)

    def _read_all(self, streams: Sequence[EngineStream]) -> None:
        """The reader is done with `streams` (they ended, or failed): close them, charge as they stand."""
        self._streams_read = True
        close_all(streams)

    def _release(self, streams: list[EngineStream]) -> None:
        # Also here, not only where the events end: a response closed before its first event never runs
        # the event generator's cleanup, and the streams must still give back their nodes' slots.
        streams = streams or self._left_open
        opening = self._left_opening
        if (streams or opening) and not self._streams_read:
            # The client left while they ran: charge what the engine generated once they are drained
            # (the prompts it left while they opened too, once they have).
            self._streams_read = True
            usage = self.usage or self._new_usage(self.bound.prompts)
            drain_later(
                self.ctx.drains,
                streams,
                self.unread,
                usage,
                self.bound,
                self._settle,
                opening=opening,
                on_opened=self._stream_opened,
            )
        else:
            close_all(streams)
            self._settle()
        if self.holds_key_slot and self.api_key is not None:
            self.holds_key_slot = False
            self.ctx.rate_limiter.leave(self.api_key)
        self.ctx.limiter.release()
        self.ctx.metrics.generations_in_flight.dec()

    def _check_stream_options(self) -> None:
        if self.body.stream_options is not None and not self.body.stream:
            raise invalid_param("stream_options", "only allowed when stream is true")
        if self.body.prompt_logprobs is not None and self.body.stream:
            raise invalid_param("prompt_logprobs", "not available when stream is true")

    def _opener(self) -> OpenOne:
        """How this request's streams open (once per request: its prompts share one migration budget)."""
        if self._stream_opener is None:
            pool, model, config = self.ctx.pool, self.body.model, self.ctx.config
            retried = self.ctx.metrics.retries

            def on_retry(code: grpc.StatusCode) -> None:
                retried.labels(code.name).inc()

            opener = stream_opener(pool, model, config.request_timeout_s, on_retry, self._left_opening.append)
            if config.migration_limit > 0:
                reopen = continuation_opener(pool, model, config.request_timeout_s, on_retry)
                opener = migrating(opener, Migrations(config.migration_limit, reopen, self._migrated))
            self._stream_opener = self._observed(opener)
        return self._stream_opener

    def _observed(self, open_one: OpenOne) -> OpenOne:
        """`open_one`, telling `_stream_opened` of each stream as soon as it opens (not when all have)."""

        async def open_observed(prompt_index: int, request: engine_pb2.GenerateRequest) -> EngineStream:
            stream = await open_one(prompt_index, request)
            self._stream_opened(stream)
            return stream

        return open_observed

    def _migrated(self, migration: Migration) -> None:
        """A stream of this request moved to another engine: log it, count it, mark it on the trace."""
        log.warning(
            "request %s: prompt %d choices %s moved from %s to %s after %d tokens (%s)",
            self.request_id,
            migration.prompt_index,
            list(migration.choices),
            migration.source,
            migration.target,
            migration.tokens,
            migration.reason,
        )
        self.ctx.metrics.migrations.labels(migration.reason).inc()
        self._span.add_event(
            "migration",
            {
                "conduit.migration.reason": migration.reason,
                "conduit.migration.source": migration.source,
                "conduit.migration.target": migration.target,
                "conduit.migration.prompt_index": migration.prompt_index,
                "conduit.migration.tokens": migration.tokens,
            },
        )

    async def _open(self, requests: list[engine_pb2.GenerateRequest]) -> list[EngineStream]:
        try:
            return await open_streams(requests, self._opener(), self._left_open)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc) from None

    def _rpc_error(self, exc: grpc.aio.AioRpcError) -> OpenAIError:
        aliases = self.param_aliases()
        if self.constraint is not None:
            aliases = self.constraint.aliases() | aliases
        return from_rpc_error(exc, self.ctx.config.retry_after_s, aliases)

    def _choice(
        self, choices: ChoiceSet, prompt_index: int, message: engine_pb2.GenerateResponse
    ) -> tuple[ChoiceState, bool]:
        index = message.index
        if index >= self.n:
            raise OpenAIError(
                502,
                f"The engine sent choice index {index} for n={self.n}.",
                type="server_error",
                code="engine_error",
            )
        return choices.get(prompt_index, index)

    def _finish(self, choice: ChoiceState, message: engine_pb2.GenerateResponse) -> None:
        error = ending_error(message.finish_reason, choice.index)
        if error is not None:
            raise error
        choice.finish_reason = FINISH_REASONS.get(message.finish_reason, "stop")
        self.bound.finished(choice.index // self.n)

    def _finished(self, usage: UsageTotals, choices: ChoiceSet) -> None:
        """The request's output is complete: count its tokens, add them to its span, log its text."""
        self.ctx.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.ctx.metrics.completion_tokens.inc(usage.completion_tokens)
        trace.get_current_span().set_attributes(
            {tracing.INPUT_TOKENS: usage.prompt_tokens, tracing.OUTPUT_TOKENS: usage.completion_tokens}
        )
        if self.ctx.config.log_prompts:
            texts = ["".join(choice.texts) for choice in choices.ordered()]
            log.info("request %s: completion %r", self.request_id, texts)

    def _stream_error(self, error: OpenAIError) -> str:
        log.warning("request %s: stream ended by error %s: %s", self.request_id, error.status, error.message)
        self.ctx.metrics.stream_errors.labels(error.code or str(error.status)).inc()
        return error_event(error)

    @abstractmethod
    async def handle(self) -> Response:
        """Validate and open the streams (errors here become the HTTP status), then respond."""


class ChunkedHandler(GenerationHandler):
    """The OpenAI-style flow: every engine message becomes a chunk of streamed choices (or is accumulated
    into one response). Subclasses implement the chunk hooks."""

    # -- chunk hooks -------------------------------------------------------------------------------

    def opening_choice(self, choice: ChoiceState) -> dict[str, Any] | None:
        """The choice of a chunk sent before a choice's first text (chat's role delta), or None."""
        return None

    @abstractmethod
    def delta_choice(
        self, choice: ChoiceState, text: str, logprobs: Sequence[engine_pb2.PositionLogprobs]
    ) -> dict[str, Any] | RawJson | None:
        """The streamed choice for new text of `choice` (called before the text is added to it), or None
        when nothing is to be sent yet (a parser holds the text back); RawJson: the choice already encoded."""

    def text_delta(self, choice: ChoiceState) -> tuple[str, str] | None:
        """When from now on `delta_choice` of every message of `choice` that adds text and no logprobs is
        the text's JSON string between two fixed parts: those parts (the push then writes such messages
        without calling the hooks, handlers/chunk_push.py); else None."""
        return None

    def flush_choice(self, choice: ChoiceState) -> dict[str, Any] | None:
        """A streamed choice with what was held back until the choice's end, sent before its finish."""
        return None

    @abstractmethod
    def finish_choice(self, choice: ChoiceState) -> dict[str, Any]:
        """The streamed choice that carries `choice.finish_reason`."""

    @abstractmethod
    def response(self, choices: list[ChoiceState], usage: UsageTotals) -> BaseModel:
        """The non-streamed response."""

    async def handle(self) -> Response:
        """Validate and open the streams (errors here become the HTTP status), then respond."""
        self._check_stream_options()
        requests = self.prepared_requests()
        self.admit(requests)
        streaming = False
        streams: list[EngineStream] = []
        try:
            streams = await self._open(requests)
            self.opened(streams)
            choices = ChoiceSet(self.n, self.new_choice)
            usage = self._new_usage(len(requests))
            if self.body.stream:
                streaming = True
                pace = ClientPace()
                events = self._events(streams, choices, usage, pace)
                response = EventStreamResponse(events, on_close=lambda: self._release(streams), pace=pace)
                return self._with_limit_headers(response)
            return self._with_limit_headers(await self._accumulate(streams, choices, usage))
        finally:
            if not streaming:
                self._release(streams)

    async def _accumulate(
        self, streams: list[EngineStream], choices: ChoiceSet, usage: UsageTotals
    ) -> Response:
        with self._reading(streams):
            try:
                async with contextlib.aclosing(read_messages(streams, self.unread)) as messages:
                    async for prompt_index, message in messages:
                        self._count(usage, prompt_index, message)
                        choice, _ = self._choice(choices, prompt_index, message)
                        choice.add(message)
                        if message.prompt_logprobs:
                            self.prompt_logprobs[prompt_index] = list(message.prompt_logprobs)
                        if message.finished:
                            self._finish(choice, message)
            except grpc.aio.AioRpcError as exc:
                raise self._rpc_error(exc) from None
        self._finished(usage, choices)
        # prompt_logprobs is a vLLM extra: absent (not null) unless asked for, like OpenAI's shape.
        exclude = self.absent_prompt_logprobs if self.body.prompt_logprobs is None else None
        body = self.response(choices.ordered(), usage).model_dump_json(exclude=exclude)
        return Response(body, media_type="application/json")

    def response_fields(self, usage: UsageTotals) -> dict[str, Any]:
        """The fields every non-streamed response has besides its choices: id, created, model, usage."""
        return {
            "id": self.response_id,
            "created": self.created,
            "model": self.body.model,
            "usage": Usage.model_validate(usage.as_dict()),
        }

    def _prompt_logprobs(self, prompt_index: int) -> list[dict[str, Any] | None] | None:
        if self.body.prompt_logprobs is None:
            return None
        return prompt_logprobs_entries(self.prompt_logprobs.get(prompt_index, ()))

    async def _events(
        self, streams: list[EngineStream], choices: ChoiceSet, usage: UsageTotals, pace: ClientPace
    ) -> AsyncIterator[str]:
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        running = bool(options and options.continuous_usage_stats)
        encoder = ChunkEncoder(
            id=self.response_id,
            object=self.chunk_object,
            created=self.created,
            model=self.body.model,
            usage_mode="running" if running else "final" if include_usage else "none",
        )
        with self._reading(streams):
            try:
                for stream in streams:
                    # Opening chunks precede every token: running usage there counts the prompt only.
                    first = stream.first.usage
                    usage.update(
                        stream.prompt_index,
                        engine_pb2.Usage(
                            prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens
                        ),
                    )
                # Closed when the client leaves, so that nothing reads the streams but their drain. While
                # the client is behind, what has arrived meanwhile goes out merged (handlers/coalesce.py).
                pushed = self._push_chunks(streams, pace, encoder, choices, usage)
                try:
                    async with contextlib.aclosing(read_batches(streams, self.unread, pace)) as batches:
                        async for batch in batches:
                            if len(batch) == 1:  # the common case: one message, nothing to merge
                                prompt_index, message = batch[0]
                                events = self._message_events(encoder, choices, usage, prompt_index, message)
                            else:
                                events = "".join(
                                    self._message_events(encoder, choices, usage, prompt_index, message)
                                    for prompt_index, message in merge_batch(batch)
                                )
                            if events:
                                yield events
                finally:
                    if pushed:
                        streams[0].push_to(None)  # before the streams close or drain
                if include_usage:
                    yield encoder.usage_chunk(usage.as_dict())
                self._finished(usage, choices)
            except grpc.aio.AioRpcError as exc:
                yield self._stream_error(self._rpc_error(exc))
            except OpenAIError as exc:
                yield self._stream_error(exc)
            except Exception:
                log.exception("request %s: stream failed", self.request_id)
                yield self._stream_error(
                    OpenAIError(
                        500, "Internal error while streaming.", type="server_error", code="internal_error"
                    )
                )
            yield DONE_EVENT

    def _push_chunks(
        self,
        streams: list[EngineStream],
        pace: ClientPace,
        encoder: ChunkEncoder,
        choices: ChoiceSet,
        usage: UsageTotals,
    ) -> bool:
        """Have the only stream's plain messages written as they arrive (handlers/chunk_push.py)."""
        writer = pace.writer
        if len(streams) != 1 or writer is None:
            return False
        stream = streams[0]
        prompt_index = stream.prompt_index
        events = functools.partial(self._message_events, encoder, choices, usage, prompt_index)
        text_events = None
        if self.n == 1:
            text_events = functools.partial(self._text_events, encoder, choices, usage, prompt_index)
        return stream.push_to(ChunkPush(events, writer, self.n, text_events))

    def _text_events(
        self, encoder: ChunkEncoder, choices: ChoiceSet, usage: UsageTotals, prompt_index: int
    ) -> TextEvents | Literal[False] | None:
        """How the push writes the only choice's messages that just add text, once the choice is open and
        they all make the same event around their text (`text_delta`); None while they may yet, False
        once they never will (the choice has sent text: the hook's answer holds from then on)."""
        choice = choices.made(prompt_index, 0)
        if choice is None:
            return None
        delta = self.text_delta(choice)
        event = encoder.text_event(*delta) if delta is not None else None
        if event is None:
            return False if choice.texts or delta is not None else None
        # Without a key's reservation to hold, counting a message only takes its usage.
        counted = self._count if self.reservation is not None else UsageTotals.update_from
        count = functools.partial(counted, usage, prompt_index)
        return TextEvents(event[0].encode(), event[1].encode(), choice.texts, count)

    def _message_events(
        self,
        encoder: ChunkEncoder,
        choices: ChoiceSet,
        usage: UsageTotals,
        prompt_index: int,
        message: engine_pb2.GenerateResponse,
    ) -> str:
        """The SSE events one engine message makes (none while a parser holds its text back)."""
        choice, is_new = self._choice(choices, prompt_index, message)
        events = ""
        opening = self.opening_choice(choice) if is_new else None
        if opening is not None:
            # Usage as it was before this message: the opening chunk precedes its tokens.
            events = encoder.one(opening, usage.as_dict)
        self._count(usage, prompt_index, message)
        text, logprobs = message.text, message.logprobs  # each field read builds a wrapper: read once
        if text or logprobs:
            delta = self.delta_choice(choice, text, logprobs)
            if delta is not None:
                events += encoder.one(delta, usage.as_dict)
            choice.texts.append(text)
        if message.finished:
            self._finish(choice, message)
            for last in (self.flush_choice(choice), self.finish_choice(choice)):
                if last is not None:
                    events += encoder.one(last, usage.as_dict)
        return events
