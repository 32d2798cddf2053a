"""POST /v1/responses: input items (plus a chained conversation) → GenerateRequest.chat; the one choice's
parsed output → Responses output items and typed events; stored, background and streamed variants.

The flow is the base's (prepare → admit → open → read) with its own ending: events instead of chunks.
A foreground response writes its record twice (in_progress once the engine accepted it, final before
its terminal event); a background one also appends each engine message's events for stream resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from starlette.responses import JSONResponse, Response

from conduit.engine.v1 import engine_pb2
from conduit_common.prompt_size import is_too_long
from conduit_gateway.context import GatewayContext
from conduit_gateway.errors import OpenAIError, invalid_param
from conduit_gateway.handlers.base import GenerationHandler
from conduit_gateway.handlers.chat_output import ChatChoiceState
from conduit_gateway.handlers.choices import ChoiceSet, UsageTotals, safe_logprob
from conduit_gateway.handlers.response_events import ResponseWriter, item_id
from conduit_gateway.handlers.response_input import Message, map_input, output_messages, to_pb
from conduit_gateway.handlers.sampling import sampling_params
from conduit_gateway.handlers.streams import EngineStream, read_batches
from conduit_gateway.http.sse import ClientPace, EventStreamResponse
from conduit_gateway.keys.keys_file import ApiKey
from conduit_gateway.parsers.chat_output import ChatOutputParser, OutputDelta
from conduit_gateway.parsers.reasoning import reasoning_parser_class
from conduit_gateway.parsers.tool_calls import ToolCallParser, tool_call_parser_class
from conduit_gateway.parsers.tool_calls.forced import ForcedToolCallParser
from conduit_gateway.prompt_limits import PromptLimit, prompt_limit
from conduit_gateway.responses.service import ResponsesService
from conduit_gateway.responses.store import StoredResponse, StoreUnavailable, unavailable_error
from conduit_gateway.routing.node import EngineNode
from conduit_gateway.routing.selection.base import RouteRequest
from conduit_gateway.schemas.responses import ResponsesRequest
from conduit_gateway.schemas.structured import (
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolDefinition,
)
from conduit_gateway.structured import validation
from conduit_gateway.structured.constraints import Constraint
from conduit_gateway.structured.tools import ToolPlan, plan_tools

log = logging.getLogger(__name__)

_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = {"reasoning.encrypted_content", _LOGPROBS}
_MAX_TOP_LOGPROBS = 20
_UNSUPPORTED = ("prompt", "conversation")
_SERVICE_TIERS = ("auto", "default")


def sse(event: dict[str, Any]) -> str:
    """One Responses event as OpenAI frames it: its type as the SSE event name, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ResponsesHandler(GenerationHandler):
    endpoint = "responses"
    id_prefix = "resp"
    chunk_object = "response"
    absent_prompt_logprobs: dict[str, Any] = {}
    body: ResponsesRequest
    tools: ToolPlan

    def __init__(
        self,
        ctx: GatewayContext,
        service: ResponsesService,
        body: ResponsesRequest,
        request_id: str,
        api_key: ApiKey | None = None,
    ) -> None:
        super().__init__(ctx, body, request_id, api_key)
        self.service = service
        self.response_id = item_id("resp")
        self.stored = service.store is not None and body.store is not False
        self.background = bool(body.background)
        self.history: list[Message] = []
        self.turn: list[Message] = []  # instructions-free conversation of this turn's prompt
        self.input_items: list[dict[str, Any]] = []
        self.reasoning_tokens = 0

    # -- request mapping ---------------------------------------------------------------------------

    async def _conversation(self) -> None:
        """Check the request and build this turn's conversation (chained, mapped, truncated)."""
        self._check_request()
        if self.body.previous_response_id is not None:
            self.history = await self._previous_conversation(self.body.previous_response_id)
        assert self.body.input is not None
        messages, self.input_items = map_input(self.body.input, self.history)
        self.turn = self.history + messages
        self.tools = self._plan_tools()
        if self.body.truncation == "auto":
            await self._truncate()

    async def count_input_tokens(self) -> JSONResponse:
        """POST /v1/responses/input_tokens: the prompt this request would have, counted by the engine."""
        await self._conversation()
        node = await self.ctx.pool.acquire(RouteRequest(model=self.body.model))
        chat = self._chat_input()
        limit = prompt_limit(self.ctx.pool, self.body.model)
        if limit is not None:
            limit.check_chat("input", chat)
        count = len(await self._tokenize(node, chat))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    async def _tokenize(self, node: EngineNode, chat: engine_pb2.ChatInput) -> list[int]:
        try:
            reply = await node.client.tokenize(
                engine_pb2.TokenizeRequest(chat=chat), self.ctx.config.model_info_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc) from None
        return list(reply.token_ids)

    async def handle(self) -> Response:
        await self._conversation()
        requests = self.prepared_requests()
        writer = ResponseWriter(self._initial_response())
        if self.background:
            return await self._start_background(requests, writer)
        self.admit(requests)
        streams: list[EngineStream] = []
        streaming = False
        try:
            streams = await self._open(requests)
            self.opened(streams)
            if self.stored:
                await self._save(writer)  # 503 before any output when the store is down
            if self.body.stream:
                streaming = True
                pace = ClientPace()
                events = self._sse_events(streams, writer, pace)
                return self._with_limit_headers(
                    EventStreamResponse(events, on_close=lambda: self._release(streams), pace=pace)
                )
            try:
                async for _ in self._generate(streams, writer, persist=False):
                    pass
            except asyncio.CancelledError:
                self._left_early(writer)  # the client went away
                raise
            if self.stored:
                await self._save(writer)
            if self._failure is not None:
                raise self._failure
            return self._with_limit_headers(JSONResponse(writer.response))
        finally:
            if not streaming:
                self._release(streams)

    def _check_request(self) -> None:
        body = self.body
        for name in _UNSUPPORTED:
            if getattr(body, name) is not None:
                raise invalid_param(name, "is not supported by this server")
        if body.input is None:
            raise invalid_param("input", "is required")
        if body.n not in (None, 1):
            raise invalid_param("n", "a response has one output; n must be 1")
        if body.max_tokens is not None:
            raise invalid_param("max_tokens", "is not a Responses field; use max_output_tokens")
        if body.stream_options is not None and not body.stream:
            raise invalid_param("stream_options", "only allowed when stream is true")
        if body.prompt_logprobs is not None:
            raise invalid_param("prompt_logprobs", "is not available on /v1/responses")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= _MAX_TOP_LOGPROBS:
            raise invalid_param(
                "top_logprobs", f"must be in [0, {_MAX_TOP_LOGPROBS}], got {body.top_logprobs}"
            )
        for index, name in enumerate(body.include or ()):
            if name not in _INCLUDABLE:
                raise invalid_param(f"include[{index}]", f"{name!r} is not supported by this server")
        if body.max_tool_calls is not None and body.max_tool_calls < 1:
            raise invalid_param("max_tool_calls", f"must be >= 1, got {body.max_tool_calls}")
        if body.service_tier is not None and body.service_tier not in _SERVICE_TIERS:
            raise invalid_param("service_tier", f"must be one of {', '.join(_SERVICE_TIERS)}")
        _check_metadata(body.metadata)
        if self.service.store is None:
            if body.store:
                raise invalid_param("store", "this gateway runs without a response store")
            if body.previous_response_id is not None:
                raise invalid_param("previous_response_id", "this gateway runs without a response store")
        if self.background and not self.stored:
            raise invalid_param("background", "background responses must be stored (store: true)")

    async def _previous_conversation(self, previous_id: str) -> list[Message]:
        try:
            record = await self.service.get(previous_id, self._key_name)
        except StoreUnavailable as exc:
            raise unavailable_error(str(exc)) from None
        if record is None:
            raise OpenAIError(
                404,
                f"Previous response with id '{previous_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if record.response["status"] in ("queued", "in_progress"):
            raise invalid_param("previous_response_id", f"response '{previous_id}' has not finished yet")
        return record.conversation

    def _plan_tools(self) -> ToolPlan:
        body = self.body
        definitions = []
        for index, tool in enumerate(body.tools or ()):
            if tool.type != "function":
                raise invalid_param(
                    f"tools[{index}].type", f"tool type {tool.type!r} is not supported; use 'function'"
                )
            if tool.name is None:
                raise invalid_param(f"tools[{index}].name", "is required for a function tool")
            definitions.append(
                ToolDefinition(
                    type="function",
                    function=FunctionDefinition(
                        name=tool.name,
                        description=tool.description,
                        parameters=tool.parameters,
                        strict=tool.strict,
                    ),
                )
            )
        choice = body.tool_choice
        if choice is not None and not isinstance(choice, str):
            if choice.type != "function" or choice.name is None:
                raise invalid_param("tool_choice", f"tool_choice type {choice.type!r} is not supported")
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        try:
            return plan_tools(
                definitions or None, choice, body.parallel_tool_calls, self.ctx.config.tool_call_parser
            )
        except OpenAIError as exc:
            # Chat spells a tool's fields under `function`; a Responses tool is flat.
            if exc.param is not None:
                flat = exc.param.replace(".function.", ".")
                exc.message = exc.message.replace(exc.param, flat)
                exc.param = flat
            raise

    async def _token_count(self, node: EngineNode, limit: PromptLimit | None) -> int | None:
        """The prompt's tokens; None when it cannot fit the context (too long to be tokenized)."""
        chat = self._chat_input()
        if limit is not None:
            try:
                limit.check_chat("input", chat)
            except OpenAIError:
                return None
        try:
            return len(await self._tokenize(node, chat))
        except OpenAIError as exc:
            if exc.status == 400 and is_too_long(exc.message):
                return None  # the rendered template is over the engine's bound
            raise

    async def _truncate(self) -> None:
        """truncation auto: drop the oldest items until the prompt and max_output_tokens (at least one
        token) fit the model's context; instructions always stay."""
        node = await self.ctx.pool.acquire(RouteRequest(model=self.body.model))
        info = node.model_info
        if info is None or not info.max_model_len:
            return
        limit = prompt_limit(self.ctx.pool, self.body.model)
        while True:
            # Items too long for the context by their size alone go without being tokenized.
            fits = await self._token_count(node, limit)
            room = info.max_model_len - (self.body.max_output_tokens or 1)
            if (fits is not None and fits <= room) or len(self.turn) <= 1:
                return
            del self.turn[0]
            # A tool result whose call was dropped would answer nothing: drop it too.
            while len(self.turn) > 1 and self.turn[0]["role"] == "tool":
                del self.turn[0]

    def _chat_input(self) -> engine_pb2.ChatInput:
        messages = list(self.turn)
        if self.body.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.body.instructions})
        chat = engine_pb2.ChatInput(messages=[to_pb(message) for message in messages])
        if self.tools.tools_json is not None:
            chat.tools_json = self.tools.tools_json
        return chat

    def build_inputs(self) -> list[engine_pb2.GenerateRequest]:
        return [engine_pb2.GenerateRequest(chat=self._chat_input())]

    def build_sampling(self) -> engine_pb2.SamplingParams:
        params = sampling_params(
            self.body,
            max_tokens=("max_output_tokens", self.body.max_output_tokens),
            logprobs=("top_logprobs", (self.body.top_logprobs or 0) if self._wants_logprobs else None),
        )
        self.constraint = self._constraint()
        if self.constraint is not None:
            reasoning = self.ctx.config.reasoning_parser
            after = reasoning_parser_class(reasoning).end_tag if reasoning else None
            self.constraint.apply(params, after=after)
        parser = self._tool_parser_class()
        if parser is not None and parser.needs_special_tokens and self.body.skip_special_tokens is None:
            params.skip_special_tokens = False
        return params

    @property
    def _wants_logprobs(self) -> bool:
        return _LOGPROBS in (self.body.include or ())

    def _constraint(self) -> Constraint | None:
        spec = self.body.text.format if self.body.text is not None else None
        requested = None
        if spec is not None and spec.type == "json_object":
            requested = Constraint("text.format", "json_object")
        elif spec is not None and spec.type == "json_schema":
            if spec.name is None:
                raise invalid_param("text.format.name", "is required when type is 'json_schema'")
            if spec.json_schema is None:
                raise invalid_param("text.format.schema", "is required when type is 'json_schema'")
            text = validation.json_schema_text("text.format.schema", spec.json_schema)
            requested = Constraint("text.format.schema", "json_schema", text)
        forced = self.tools.constraint
        if forced is None:
            return requested
        if requested is not None:
            raise invalid_param(
                requested.param, "cannot be combined with tool_choice 'required' or a named function"
            )
        return forced

    def _tool_parser_class(self) -> type[ToolCallParser] | None:
        if self.tools.mode == "forced":
            return ForcedToolCallParser
        name = self.ctx.config.tool_call_parser
        return tool_call_parser_class(name) if self.tools.mode == "auto" and name else None

    def param_aliases(self) -> dict[str, str]:
        return {
            "chat": "input",
            "input": "input",
            "prompt": "input",
            "tools_json": "tools",
            "chat.tools_json": "tools",
            "max_tokens": "max_output_tokens",
        }

    def new_choice(self, index: int, prompt_index: int) -> ChatChoiceState:
        reasoning = self.ctx.config.reasoning_parser
        tools = self._tool_parser_class()
        output = ChatOutputParser(
            reasoning_parser_class(reasoning)() if reasoning else None,
            tools() if tools else None,
            max_calls=self._max_calls(),
        )
        return ChatChoiceState(index, output=output)

    def _max_calls(self) -> int | None:
        """Calls past this many are dropped: one without parallel_tool_calls, at most max_tool_calls."""
        limits = [limit for limit in (None if self.tools.parallel else 1, self.body.max_tool_calls) if limit]
        return min(limits) if limits else None

    # -- the response object -----------------------------------------------------------------------

    def _initial_response(self) -> dict[str, Any]:
        body = self.body
        text_format: dict[str, Any] = {"type": "text"}
        spec = body.text.format if body.text is not None else None
        if spec is not None:
            text_format = spec.model_dump(by_alias=True, exclude_none=True)
        tool_choice: Any = body.tool_choice or ("auto" if body.tools else "none")
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump(exclude_none=True)
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": "queued" if self.background else "in_progress",
            "background": self.background,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "model": body.model,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {
                "effort": body.reasoning.effort if body.reasoning else None,
                "summary": body.reasoning.summary if body.reasoning else None,
            },
            "service_tier": "default",
            "store": self.stored,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": text_format},
            "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "top_logprobs": self.body.top_logprobs or 0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": body.truncation or "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
            "output_text": "",
        }

    @property
    def _key_name(self) -> str | None:
        return self.api_key.name if self.api_key is not None else None

    def _record(self, writer: ResponseWriter) -> StoredResponse:
        conversation = self.turn + output_messages(writer.output)
        return StoredResponse(
            writer.response,
            self.input_items,
            conversation,
            owner=self.service.store.replica if self.service.store is not None else None,
            key=self._key_name,
        )

    async def _save(self, writer: ResponseWriter) -> None:
        try:
            await self.service.put(self._record(writer))
        except StoreUnavailable as exc:
            raise unavailable_error(str(exc)) from None

    def _usage(self, usage: UsageTotals) -> dict[str, Any]:
        totals = usage.as_dict()
        return {
            "input_tokens": totals["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": totals["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": totals["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": totals["total_tokens"],
        }

    # -- running -----------------------------------------------------------------------------------

    _failure: OpenAIError | None = None

    async def _generate(
        self,
        streams: list[EngineStream],
        writer: ResponseWriter,
        persist: bool,
        pace: ClientPace | None = None,
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The response's event batches, opening to terminal (one batch per engine message, or per read
        of a streaming client that is behind: `pace`); with `persist` (background) each batch is appended
        to the store as it comes, and the final record and events are stored before the terminal batch
        is handed out."""
        choices = ChoiceSet(1, self.new_choice)
        usage = self._new_usage(len(streams))
        appender = EventAppender(self.service, self.response_id) if persist else None
        batch = writer.opening()
        status, reason = "completed", None
        left = False  # cancelled (the client left, or the background run was): the streams are drained
        try:
            if appender is not None:
                appender.add(batch, self._record(writer))  # the record says in_progress
            yield batch
            try:
                # While a streaming client is behind, the messages that arrived meanwhile come in one batch:
                # each is parsed as before (reasoning tokens counted per message), and the batch's
                # deltas of one item go out as one event (ResponseWriter.merged).
                async with contextlib.aclosing(read_batches(streams, self.unread, pace)) as batches:
                    async for messages in batches:
                        batch = []
                        failure: OpenAIError | None = None
                        for prompt_index, message in messages:
                            try:
                                ended = self._feed(writer, choices, usage, prompt_index, message, batch)
                            except OpenAIError as exc:
                                failure = exc  # raised once the events before it went out
                                break
                            if ended is not None:
                                status, reason = ended
                        batch = writer.merged(batch)
                        if batch:
                            if appender is not None:
                                appender.add(batch)
                            yield batch
                        if failure is not None:
                            raise failure
            except grpc.aio.AioRpcError as exc:
                raise self._rpc_error(exc) from None
            self._finished(usage, choices)
            final = writer.finish(status, self._usage(usage), reason)
        except (asyncio.CancelledError, GeneratorExit) as exc:
            left = True
            if not persist or isinstance(exc, GeneratorExit):
                raise
            final = writer.finish("cancelled", self._usage(usage))
            log.info("response %s: cancelled", self.response_id)
        except OpenAIError as exc:
            self._failure = exc
            self._stream_error(exc)
            final = writer.finish("failed", self._usage(usage), error=exc)
        finally:
            if not left:
                self._read_all(streams)
        if appender is not None:
            appender.add(final, self._record(writer))
            await appender.drain()
        elif self.stored and self.body.stream:
            await self.service.put(self._record(writer))
        yield final

    def _feed(
        self,
        writer: ResponseWriter,
        choices: ChoiceSet,
        usage: UsageTotals,
        prompt_index: int,
        message: engine_pb2.GenerateResponse,
        events: list[dict[str, Any]],
    ) -> tuple[str, str | None] | None:
        """Add the events of one engine message to `events`; at the choice's end, the response's final
        status and incomplete reason (OpenAIError when the engine aborted it)."""
        self._count(usage, prompt_index, message)
        choice, _ = self._choice(choices, prompt_index, message)
        assert isinstance(choice, ChatChoiceState)
        if message.text:
            choice.texts.append(message.text)
            delta = choice.output.feed(message.text)
            self.reasoning_tokens += reasoning_share(delta, len(message.token_ids))
            logprobs = _logprob_entries(message.logprobs) if self._wants_logprobs else []
            events += writer.feed(delta, logprobs)
        if not message.finished:
            return None
        self._finish(choice, message)
        events += writer.feed(choice.output.finish())
        if choice.finish_reason == "length":
            return "incomplete", "max_output_tokens"
        if choice.finish_reason == "abort":
            raise OpenAIError(
                503, "The engine aborted the response.", type="server_error", code="engine_aborted"
            )
        return "completed", None

    async def _sse_events(
        self, streams: list[EngineStream], writer: ResponseWriter, pace: ClientPace
    ) -> AsyncIterator[str]:
        finished = False
        try:
            async with contextlib.aclosing(self._generate(streams, writer, False, pace)) as batches:
                async for batch in batches:
                    yield "".join(sse(event) for event in batch)
            finished = True
        except StoreUnavailable as exc:
            finished = True
            yield sse(writer.error_event(unavailable_error(str(exc))))
        finally:
            if not finished:
                self._left_early(writer)

    def _left_early(self, writer: ResponseWriter) -> None:
        """The client left before the end: a stored record says cancelled rather than in_progress."""
        if self.stored and not writer.finished:
            writer.finish("cancelled", None)
            asyncio.ensure_future(self._save_quietly(writer))

    async def _save_quietly(self, writer: ResponseWriter) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self.service.put(self._record(writer))

    # -- background --------------------------------------------------------------------------------

    async def _start_background(
        self, requests: list[engine_pb2.GenerateRequest], writer: ResponseWriter
    ) -> Response:
        self.admit(requests)  # counts against the key and the gateway until the run ends
        if self.api_key is not None:
            # The key's concurrent slot of the HTTP request ends with it; the run holds its own.
            self.ctx.rate_limiter.occupy(self.api_key)
            self.holds_key_slot = True
        try:
            await self.service.append_events(self.response_id, writer.queued(), self._record(writer))
        except StoreUnavailable as exc:
            self._release([])
            raise unavailable_error(str(exc)) from None
        queued = writer.snapshot()
        self.service.run(self.response_id, self._run_background(requests, writer))
        if self.body.stream:
            events = self.service.follow(self.response_id, -1)
            return self._with_limit_headers(EventStreamResponse(sse_stream(events)))
        return self._with_limit_headers(JSONResponse(queued))

    async def _run_background(
        self, requests: list[engine_pb2.GenerateRequest], writer: ResponseWriter
    ) -> None:
        streams: list[EngineStream] = []
        try:
            try:
                streams = await self._open(requests)
            except OpenAIError as exc:
                final = writer.opening() + writer.finish("failed", None, error=exc)
                await self.service.append_events(self.response_id, final, self._record(writer))
                return
            self.opened(streams)
            async for _ in self._generate(streams, writer, persist=True):
                pass
        except StoreUnavailable as exc:
            log.warning("response %s: the store went away, run abandoned: %s", self.response_id, exc)
        except Exception:
            log.exception("response %s: background run failed", self.response_id)
            if not writer.finished:
                internal = OpenAIError(500, "Internal error while generating.", type="server_error")
                writer.finish("failed", None, error=internal)
                with contextlib.suppress(StoreUnavailable):
                    await self.service.put(self._record(writer))
        except asyncio.CancelledError:
            # Cancelled before the engine answered (or while its final record was being written).
            if not writer.finished:
                writer.finish("cancelled", None)
                with contextlib.suppress(StoreUnavailable):
                    await self.service.put(self._record(writer))
        finally:
            self._release(streams)


class EventAppender:
    """Appends a background response's events in order without holding up the run: whatever queued
    while one write was in flight goes in the next, so a fast engine costs fewer round trips than
    messages. A store failure surfaces at the next `add` or at `drain`."""

    def __init__(self, service: ResponsesService, response_id: str) -> None:
        self._service = service
        self._id = response_id
        self._events: list[dict[str, Any]] = []
        self._record: StoredResponse | None = None
        self._task: asyncio.Task[None] | None = None

    def add(self, events: list[dict[str, Any]], record: StoredResponse | None = None) -> None:
        self._events.extend(events)
        if record is not None:
            self._record = record
        if self._task is not None and self._task.done():
            self._task.result()  # raises StoreUnavailable from the last write
            self._task = None
        if self._task is None:
            self._task = asyncio.create_task(self._write())

    async def _write(self) -> None:
        while self._events or self._record is not None:
            events, self._events = self._events, []
            record, self._record = self._record, None
            await self._service.append_events(self._id, events, record)

    async def drain(self) -> None:
        """Wait until everything added is stored."""
        if self._task is not None:
            await self._task


async def sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Stored events as SSE; the store failing mid-way ends the stream with an `error` event."""
    sequence = -1
    try:
        async for event in events:
            sequence = event["sequence_number"]
            yield sse(event)
    except StoreUnavailable as exc:
        error = unavailable_error(str(exc))
        fields = {"code": error.code, "message": error.message, "param": error.param}
        yield sse({"type": "error", "sequence_number": sequence + 1, **fields})


def _logprob_entries(positions: Sequence[engine_pb2.PositionLogprobs]) -> list[dict[str, Any]]:
    """OpenAI's output_text logprobs: token, logprob, bytes and the top alternatives."""
    return [
        {**_token(position.token), "top_logprobs": [_token(top) for top in position.top]}
        for position in positions
    ]


def _token(token: engine_pb2.TokenLogprob) -> dict[str, Any]:
    return {"token": token.text, "logprob": safe_logprob(token.logprob), "bytes": list(token.text.encode())}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise invalid_param("metadata", "holds at most 16 pairs")
    for key, value in metadata.items():
        if len(key) > 64:
            raise invalid_param("metadata", f"keys are at most 64 characters, got {len(key)}")
        if len(value) > 512:
            raise invalid_param("metadata", f"values are at most 512 characters (key {key!r})")


def reasoning_share(delta: OutputDelta, tokens: int) -> int:
    """Reasoning tokens of one engine message: all of them when its text is reasoning only; when one
    message carries the end of the reasoning and the answer's start (the engine sends several tokens at
    once when the reader lags), the reasoning's share by characters, at least one token."""
    if not delta.reasoning or tokens == 0:
        return 0
    rest = len(delta.content) + sum(
        len(call.arguments or "") + len(call.name or "") for call in delta.tool_calls
    )
    if rest == 0:
        return tokens
    share = round(tokens * len(delta.reasoning) / (len(delta.reasoning) + rest))
    return min(tokens, max(1, share))
