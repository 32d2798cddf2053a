"""POST /v1/messages (Anthropic's Messages API) on the shared generation flow: system, messages and tools
→ GenerateRequest.chat; the output, split by the configured reasoning and tool-call parsers, → a Message's
thinking, text and tool_use blocks, streamed with Anthropic's event grammar (message_start, ping,
content_block_start/delta/stop, message_delta, message_stop, error).

POST /v1/messages/count_tokens maps the same fields and asks an engine's Tokenize for the prompt's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from conduit.engine.v1 import engine_pb2
from conduit_gateway.context import GatewayContext
from conduit_gateway.errors import (
    OpenAIError,
    from_rpc_error,
    invalid_param,
    model_not_found,
    no_engine_ready,
)
from conduit_gateway.handlers import fields
from conduit_gateway.handlers.base import ChunkedHandler
from conduit_gateway.handlers.chat_output import ChatChoiceState
from conduit_gateway.handlers.choices import ChoiceSet, ChoiceState, UsageTotals
from conduit_gateway.handlers.coalesce import merge_batch
from conduit_gateway.handlers.message_blocks import Event, MessageBlocks, sse
from conduit_gateway.handlers.streams import Batch, EngineStream, read_batches
from conduit_gateway.handlers.thinking_budget import BudgetedStream, ThinkingBudget
from conduit_gateway.http.anthropic import stream_error_event
from conduit_gateway.http.sse import ClientPace
from conduit_gateway.keys.keys_file import ApiKey
from conduit_gateway.parsers.chat_output import ChatOutputParser
from conduit_gateway.parsers.reasoning import reasoning_parser_class
from conduit_gateway.parsers.tool_calls import ToolCallParser, tool_call_parser_class
from conduit_gateway.parsers.tool_calls.forced import ForcedToolCallParser
from conduit_gateway.prompt_limits import prompt_limit
from conduit_gateway.schemas.messages import (
    ContentBlockParam,
    Message,
    MessageInputs,
    MessagesRequest,
    MessageTokensCount,
    ToolParam,
    Usage,
)
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

# Block types of Anthropic's API this server cannot take (no vision, files, citations or server tools).
_TEXT_ONLY = "only text, tool_use, tool_result, thinking and redacted_thinking blocks are supported"
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_TOKENIZE_TIMEOUT_S = 30.0


class MessagesHandler(ChunkedHandler):
    endpoint = "messages"
    id_prefix = "msg"
    chunk_object = "message"  # unused: this API streams its own events
    absent_prompt_logprobs: dict[str, Any] = {}
    body: MessagesRequest
    tools: ToolPlan  # set by build_inputs
    # Seconds without engine output after which a `ping` event keeps the stream (and proxies) alive.
    ping_interval_s: float = 10.0

    def __init__(
        self, ctx: GatewayContext, body: MessagesRequest, request_id: str, api_key: ApiKey | None = None
    ) -> None:
        super().__init__(ctx, body, request_id, api_key)  # type: ignore[arg-type]  # not a SamplingRequest
        self.response_id = f"msg_{request_id}"
        self.thinking_budget: ThinkingBudget | None = None  # set by build_sampling
        self.answer_sampling = engine_pb2.SamplingParams()

    # -- request ---------------------------------------------------------------------------------------

    def build_inputs(self) -> list[engine_pb2.GenerateRequest]:
        chat, self.tools = prompt_input(self.body, self.ctx.config.tool_call_parser)
        return [engine_pb2.GenerateRequest(chat=chat)]

    def build_sampling(self) -> engine_pb2.SamplingParams:
        body = self.body
        params = engine_pb2.SamplingParams(max_tokens=fields.uint32("max_tokens", body.max_tokens, minimum=1))
        for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
            value = getattr(body, name)
            if value is not None:
                if not low <= value <= high:
                    raise invalid_param(name, f"must be in [{low:g}, {high:g}], got {value}")
                setattr(params, name, fields.float32(name, value))
        if body.top_k is not None:
            if body.top_k < 0:
                raise invalid_param("top_k", f"must be >= 0, got {body.top_k}")
            params.top_k = fields.int32("top_k", body.top_k)
        for position, stop in enumerate(body.stop_sequences or ()):
            if not stop:
                raise invalid_param(f"stop_sequences[{position}]", "must not be empty")
            params.stop.append(fields.text(f"stop_sequences[{position}]", stop))
        self._check_thinking()
        self.thinking_budget = self._thinking_budget()
        self.constraint = self._constraint()
        if self.constraint is not None:
            # With a reasoning parser the structure applies to the answer, after the reasoning ends (with a
            # budget the answer is a request of its own, constrained from its start).
            reasoning = self.ctx.config.reasoning_parser
            after = reasoning_parser_class(reasoning).end_tag if reasoning else None
            self.constraint.apply(params, after=None if self.thinking_budget else after)
        parser = self._tool_parser_class()
        if parser is not None and parser.needs_special_tokens:
            params.skip_special_tokens = False
        if self.thinking_budget is None:
            return params
        self.answer_sampling = params
        return self.thinking_budget.reasoning_sampling(params)

    def _thinking_budget(self) -> ThinkingBudget | None:
        """thinking.budget_tokens, kept by the gateway (handlers/thinking_budget.py) when a reasoning
        parser says where the reasoning ends."""
        thinking, reasoning = self.body.thinking, self.ctx.config.reasoning_parser
        if thinking is None or thinking.type != "enabled" or thinking.budget_tokens is None or not reasoning:
            return None
        return ThinkingBudget(thinking.budget_tokens, reasoning_parser_class(reasoning).end_tag)

    async def _open(self, requests: list[engine_pb2.GenerateRequest]) -> list[EngineStream]:
        streams = await super()._open(requests)
        if self.thinking_budget is None:
            return streams
        (stream,) = streams
        answer = engine_pb2.GenerateRequest()
        answer.CopyFrom(requests[0])
        answer.sampling.CopyFrom(self.answer_sampling)
        opener = self._opener()
        try:
            return [
                BudgetedStream(
                    stream,
                    answer,
                    self.thinking_budget,
                    lambda request: opener(0, request),
                    self._end_tag_ids,
                )
            ]
        except BaseException:
            stream.close()
            raise

    async def _end_tag_ids(self) -> list[int]:
        assert self.thinking_budget is not None
        request = engine_pb2.TokenizeRequest(text=self.thinking_budget.end_tag, add_special_tokens=False)
        reply = await _tokenize(self.ctx, self.body.model, request)
        return list(reply.token_ids)

    def _check_thinking(self) -> None:
        thinking = self.body.thinking
        if thinking is None:
            return
        if thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise invalid_param("thinking.budget_tokens", "is required when thinking.type is 'enabled'")
            if not 1 <= thinking.budget_tokens < self.body.max_tokens:
                raise invalid_param(
                    "thinking.budget_tokens",
                    f"must be >= 1 and less than max_tokens ({self.body.max_tokens}), "
                    f"got {thinking.budget_tokens}",
                )
        elif thinking.budget_tokens is not None:
            raise invalid_param("thinking.budget_tokens", "is only allowed when thinking.type is 'enabled'")

    def _constraint(self) -> Constraint | None:
        output = self.body.output_config
        requested = None
        if output is not None and output.format is not None:
            param = "output_config.format.schema"
            requested = Constraint(
                param, "json_schema", validation.json_schema_text(param, output.format.json_schema)
            )
        forced = self.tools.constraint
        if forced is None:
            return requested
        if requested is not None:
            raise invalid_param("output_config.format", "cannot be combined with tool_choice 'any' or 'tool'")
        return forced

    def _tool_parser_class(self) -> type[ToolCallParser] | None:
        if self.tools.mode == "forced":
            return ForcedToolCallParser
        name = self.ctx.config.tool_call_parser
        return tool_call_parser_class(name) if self.tools.mode == "auto" and name else None

    def param_aliases(self) -> dict[str, str]:
        return {
            "chat": "messages",
            "input": "messages",
            "prompt": "messages",
            "tools_json": "tools",
            "chat.tools_json": "tools",
            "stop": "stop_sequences",
        }

    # -- output ----------------------------------------------------------------------------------------

    @property
    def shows_thinking(self) -> bool:
        """Reasoning becomes thinking blocks only when asked for (Anthropic's default is no thinking)."""
        thinking = self.body.thinking
        return thinking is not None and thinking.type in ("enabled", "adaptive")

    def new_choice(self, index: int, prompt_index: int) -> MessageChoiceState:
        reasoning = self.ctx.config.reasoning_parser
        tools = self._tool_parser_class()
        output = ChatOutputParser(
            reasoning_parser_class(reasoning)() if reasoning else None,
            tools() if tools else None,
            max_calls=None if self.tools.parallel else 1,
        )
        thinking = self.body.thinking
        omitted = thinking is not None and thinking.display == "omitted"
        return MessageChoiceState(index, output=output, blocks=MessageBlocks(self.shows_thinking, omitted))

    # The OpenAI chunk hooks are not used: this API streams through its own events (_events below).
    def delta_choice(
        self, choice: ChoiceState, text: str, logprobs: Sequence[engine_pb2.PositionLogprobs]
    ) -> dict[str, Any] | None:
        return None

    def finish_choice(self, choice: ChoiceState) -> dict[str, Any]:
        return {}

    def _finish(self, choice: ChoiceState, message: engine_pb2.GenerateResponse) -> None:
        super()._finish(choice, message)
        if isinstance(choice, MessageChoiceState) and message.HasField("stop_string"):
            choice.stop_sequence = message.stop_string

    def stop_reason(self, choice: MessageChoiceState, usage: UsageTotals) -> str:
        if choice.finish_reason == "length":
            # The engine also says length when the context is full before max_tokens.
            full = usage.completion_tokens < self.body.max_tokens
            return "model_context_window_exceeded" if full else "max_tokens"
        if choice.blocks.tool_uses:
            return "tool_use"
        if choice.stop_sequence is not None:
            return "stop_sequence"
        return "end_turn"

    def usage_fields(self, usage: UsageTotals) -> dict[str, int]:
        """Anthropic's usage: input_tokens excludes what the prefix cache held (cache_read_input_tokens),
        so the whole prompt is input_tokens + cache_read_input_tokens (+ cache creation, always 0)."""
        cached = usage.as_dict()["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": usage.prompt_tokens - cached,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def response(self, choices: list[MessageChoiceState], usage: UsageTotals) -> Message:  # type: ignore[override]
        (choice,) = choices
        # The whole text parsed in one piece: the same blocks the streamed events add up to.
        choice.blocks.add(choice.output.feed(choice.text()))
        choice.blocks.add(choice.output.finish())
        choice.blocks.close()
        return Message(
            id=self.response_id,
            model=self.body.model,
            content=choice.blocks.blocks,
            stop_reason=self.stop_reason(choice, usage),
            stop_sequence=choice.stop_sequence,
            usage=Usage(**self.usage_fields(usage)),
        )

    # -- streaming -------------------------------------------------------------------------------------

    async def _events(
        self, streams: list[EngineStream], choices: ChoiceSet, usage: UsageTotals, pace: ClientPace
    ) -> AsyncIterator[str]:
        (stream,) = streams
        first = stream.first.usage
        # message_start precedes every token: its usage counts the prompt only.
        usage.update(
            0, engine_pb2.Usage(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens)
        )
        started = {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self.usage_fields(usage),
        }
        with self._reading(streams):
            yield sse("message_start", {"type": "message_start", "message": started}) + _PING
            try:
                # While the client is behind, the messages that arrived meanwhile are parsed as one
                # (handlers/coalesce.py): one delta per block instead of one per token.
                batches = read_batches(streams, self.unread, pace)
                heartbeat = _with_heartbeat(batches, self.ping_interval_s)
                async with contextlib.aclosing(heartbeat) as items:
                    async for batch in items:
                        if batch is None:
                            yield _PING
                            continue
                        events = "".join(
                            self._sse_of(choices, usage, prompt_index, message)
                            for prompt_index, message in merge_batch(batch)
                        )
                        if events:  # none while a parser holds text back
                            yield events
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

    def _sse_of(
        self, choices: ChoiceSet, usage: UsageTotals, prompt_index: int, message: engine_pb2.GenerateResponse
    ) -> str:
        """The events one engine message makes: its blocks' deltas, and the message's end."""
        choice, _ = self._choice(choices, prompt_index, message)
        assert isinstance(choice, MessageChoiceState)
        self._count(usage, prompt_index, message)
        events: list[Event] = []
        if message.text:
            events += choice.blocks.add(choice.output.feed(message.text))
            choice.texts.append(message.text)
        if message.finished:
            self._finish(choice, message)
            events += choice.blocks.add(choice.output.finish())
            events += choice.blocks.close()
            delta = {"stop_reason": self.stop_reason(choice, usage), "stop_sequence": choice.stop_sequence}
            events.append(
                (
                    "message_delta",
                    {"type": "message_delta", "delta": delta, "usage": self.usage_fields(usage)},
                )
            )
            events.append(("message_stop", {"type": "message_stop"}))
        return "".join(sse(name, data) for name, data in events)

    def _stream_error(self, error: OpenAIError) -> str:
        super()._stream_error(error)  # logs and counts it
        return stream_error_event(error, self.request_id)


@dataclass(slots=True)
class MessageChoiceState(ChatChoiceState):
    blocks: MessageBlocks = field(default_factory=lambda: MessageBlocks(thinking=False))
    stop_sequence: str | None = None


_PING = sse("ping", {"type": "ping"})


async def _with_heartbeat(items: AsyncIterator[Batch], interval_s: float) -> AsyncIterator[Batch | None]:
    """The items of `items`, with None each time `interval_s` passes without one (a ping is due)."""
    pending: asyncio.Future[Batch] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await items.aclose()  # type: ignore[attr-defined]


# -- the prompt --------------------------------------------------------------------------------------


def prompt_input(body: MessageInputs, tool_call_parser: str | None) -> tuple[engine_pb2.ChatInput, ToolPlan]:
    """system + messages + tools → the engine's ChatInput, and what the tools mean (ToolPlan)."""
    if not body.messages:
        raise invalid_param("messages", "must hold at least one message")
    last = len(body.messages) - 1
    if body.messages[last].role == "assistant":
        raise invalid_param(
            f"messages[{last}].role",
            "a final assistant message (prefill) is not supported by this server; end with a user message",
        )
    chat = engine_pb2.ChatInput(messages=_chat_messages(body))
    tools = _tool_plan(body, tool_call_parser)
    if tools.tools_json is not None:
        chat.tools_json = tools.tools_json  # plan_tools checked its free text
    return chat, tools


def _system_text(body: MessageInputs) -> str | None:
    system = body.system
    if system is None:
        return None
    if isinstance(system, str):
        return fields.text("system", system)
    return "\n".join(fields.text(f"system[{i}].text", block.text) for i, block in enumerate(system))


def _chat_messages(body: MessageInputs) -> list[engine_pb2.ChatMessage]:
    out: list[engine_pb2.ChatMessage] = []
    system = _system_text(body)
    if system:
        out.append(engine_pb2.ChatMessage(role="system", content=system))
    calls_before: set[str] = set()  # the tool_use ids of the previous assistant message
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        blocks = message.content
        if isinstance(blocks, str):
            blocks = [ContentBlockParam(type="text", text=blocks)]
        if message.role == "assistant":
            turn, calls_before = _assistant_turn(where, blocks)
            _append(out, turn)
        else:
            for turn in _user_turns(where, blocks, calls_before):
                _append(out, turn)
            calls_before = set()
    return out


def _append(out: list[engine_pb2.ChatMessage], turn: engine_pb2.ChatMessage) -> None:
    """Consecutive user (or assistant) turns are one turn, as Anthropic combines them."""
    previous = out[-1] if out else None
    if previous is not None and previous.role == turn.role and turn.role in ("user", "assistant"):
        previous.content = "\n".join(text for text in (previous.content, turn.content) if text)
        previous.tool_calls.extend(turn.tool_calls)
    else:
        out.append(turn)


def _assistant_turn(where: str, blocks: list[ContentBlockParam]) -> tuple[engine_pb2.ChatMessage, set[str]]:
    turn = engine_pb2.ChatMessage(role="assistant")
    texts: list[str] = []
    for position, block in enumerate(blocks):
        at = f"{where}.content[{position}]"
        if block.type == "text":
            texts.append(_block_text(at, block))
        elif block.type == "tool_use":
            if not block.id:
                raise invalid_param(f"{at}.id", "is required for a tool_use block")
            if not block.name:
                raise invalid_param(f"{at}.name", "is required for a tool_use block")
            if not isinstance(block.input, dict):
                raise invalid_param(f"{at}.input", "must be an object")
            turn.tool_calls.append(
                engine_pb2.ToolCall(
                    id=fields.text(f"{at}.id", block.id),
                    type="function",
                    function_name=fields.text(f"{at}.name", block.name),
                    function_arguments=fields.text(
                        f"{at}.input", json.dumps(block.input, ensure_ascii=False)
                    ),
                )
            )
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning, given back as received: not shown to the template
        elif block.type == "tool_result":
            raise invalid_param(f"{at}.type", "tool_result blocks belong in user messages")
        else:
            raise _unsupported(at, block.type)
    turn.content = "\n".join(texts)
    return turn, {call.id for call in turn.tool_calls}


def _user_turns(
    where: str, blocks: list[ContentBlockParam], calls_before: set[str]
) -> list[engine_pb2.ChatMessage]:
    """A user message → a `tool` message per tool_result (in order), then the user's text, if any."""
    turns: list[engine_pb2.ChatMessage] = []
    texts: list[str] = []
    for position, block in enumerate(blocks):
        at = f"{where}.content[{position}]"
        if block.type == "text":
            texts.append(_block_text(at, block))
        elif block.type == "tool_result":
            if not block.tool_use_id:
                raise invalid_param(f"{at}.tool_use_id", "is required for a tool_result block")
            if block.tool_use_id not in calls_before:
                raise invalid_param(
                    f"{at}.tool_use_id",
                    f"no tool_use block with id {block.tool_use_id!r} in the previous assistant message "
                    "(each tool_result answers a tool_use of the message just before it)",
                )
            content = _result_text(at, block)
            if block.is_error:
                content = f"Error: {content}"
            turns.append(engine_pb2.ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
        elif block.type in ("tool_use", "thinking", "redacted_thinking"):
            raise invalid_param(f"{at}.type", f"{block.type} blocks belong in assistant messages")
        else:
            raise _unsupported(at, block.type)
    if texts or not turns:
        turns.append(engine_pb2.ChatMessage(role="user", content="\n".join(texts)))
    return turns


def _block_text(at: str, block: ContentBlockParam) -> str:
    if block.text is None:
        raise invalid_param(f"{at}.text", "is required for a text block")
    return fields.text(f"{at}.text", block.text)


def _result_text(at: str, block: ContentBlockParam) -> str:
    content = block.content
    if content is None:
        return ""
    if isinstance(content, str):
        return fields.text(f"{at}.content", content)
    texts = []
    for position, part in enumerate(content):
        part_at = f"{at}.content[{position}]"
        if part.type != "text":
            raise _unsupported(part_at, part.type)
        texts.append(_block_text(part_at, part))
    return "\n".join(texts)


def _unsupported(at: str, kind: str) -> OpenAIError:
    return invalid_param(f"{at}.type", f"{kind!r} blocks are not supported by this server ({_TEXT_ONLY})")


def _tool_plan(body: MessageInputs, tool_call_parser: str | None) -> ToolPlan:
    """Anthropic's tools and tool_choice as chat tools, planned as chat plans them (structured/tools.py),
    with the errors naming Anthropic's fields."""
    definitions = [_tool_definition(position, tool) for position, tool in enumerate(body.tools or ())]
    choice = body.tool_choice
    parallel = (
        None
        if choice is None or choice.disable_parallel_tool_use is None
        else not choice.disable_parallel_tool_use
    )
    if choice is None:
        openai_choice: str | NamedToolChoice | None = None
    elif choice.type == "tool":
        if not choice.name:
            raise invalid_param("tool_choice.name", "is required when tool_choice.type is 'tool'")
        openai_choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    else:
        if choice.name is not None:
            raise invalid_param("tool_choice.name", "is only allowed when tool_choice.type is 'tool'")
        openai_choice = _TOOL_CHOICES[choice.type]
    try:
        plan = plan_tools(definitions or None, openai_choice, parallel, tool_call_parser)
    except OpenAIError as exc:
        raise _renamed(exc) from None
    if plan.constraint is not None:  # the engine's errors about it name Anthropic's field too
        param = plan.constraint.param.replace(".function.parameters", ".input_schema")
        plan = dataclasses.replace(plan, constraint=dataclasses.replace(plan.constraint, param=param))
    return plan


def _tool_definition(position: int, tool: ToolParam) -> ToolDefinition:
    at = f"tools[{position}]"
    if tool.type not in (None, "custom"):
        raise invalid_param(f"{at}.type", f"server tool {tool.type!r} is not supported by this server")
    if tool.input_schema is None:
        raise invalid_param(f"{at}.input_schema", "is required")
    return ToolDefinition(
        type="function",
        function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        ),
    )


def _renamed(error: OpenAIError) -> OpenAIError:
    """An error of the chat tool planner, naming Anthropic's fields (tools[i].input_schema, not
    tools[i].function.parameters) and values ('any', not 'required')."""
    message = error.message
    for old, new in ((".function.parameters", ".input_schema"), (".function.name", ".name")):
        message = message.replace(old, new)
    message = message.replace("'required', a named function or 'none'", "'any', 'tool' or 'none'")
    message = message.replace("function '", "tool '")
    message = message.replace("use 'any', 'tool'", "use tool_choice 'any', 'tool'")
    param = (
        error.param.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
        if error.param
        else None
    )
    return OpenAIError(error.status, message, type=error.type, param=param, code=error.code)


# -- count_tokens ------------------------------------------------------------------------------------


async def count_tokens(ctx: GatewayContext, body: MessageInputs) -> MessageTokensCount:
    """The prompt's length as the engine renders it: what usage.input_tokens + cache_read_input_tokens
    report for the same request."""
    # Counting needs no parser: a placeholder keeps tool_choice auto from asking for one.
    chat, _ = prompt_input(body, ctx.config.tool_call_parser or "counting")
    limit = prompt_limit(ctx.pool, body.model)
    if limit is not None:
        limit.check_chat("messages", chat)
    reply = await _tokenize(ctx, body.model, engine_pb2.TokenizeRequest(chat=chat))
    return MessageTokensCount(input_tokens=len(reply.token_ids))


async def _tokenize(
    ctx: GatewayContext, model: str, request: engine_pb2.TokenizeRequest
) -> engine_pb2.TokenizeResponse:
    """Tokenize on an engine serving `model` (404 when none does, 503 when none is ready)."""
    node = ctx.pool.serving_node(model)
    if node is None:
        await ctx.pool.refresh()  # a just-started engine may not have reported yet
        node = ctx.pool.serving_node(model)
    if node is None:
        if not ctx.pool.routable():
            raise no_engine_ready()
        raise model_not_found(model)
    try:
        return await node.client.tokenize(request, _TOKENIZE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(
            exc, ctx.config.retry_after_s, {"chat": "messages", "input": "messages"}
        ) from None
