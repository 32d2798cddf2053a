"""POST /v1/chat/completions: messages and tools → GenerateRequest.chat, choices shaped as chat deltas and
messages after the configured reasoning and tool-call parsers split them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import invalid_param
from conduit_gateway.handlers import fields
from conduit_gateway.handlers.base import ChunkedHandler
from conduit_gateway.handlers.chat_output import ChatChoiceState, delta_fields, message
from conduit_gateway.handlers.choices import ChoiceState, UsageTotals, safe_logprob, token_text_json
from conduit_gateway.handlers.sampling import sampling_params
from conduit_gateway.http.sse import RawJson, json_string
from conduit_gateway.parsers.chat_output import ChatOutputParser
from conduit_gateway.parsers.reasoning import reasoning_parser_class
from conduit_gateway.parsers.tool_calls import ToolCallParser, tool_call_parser_class
from conduit_gateway.parsers.tool_calls.forced import ForcedToolCallParser
from conduit_gateway.schemas.chat import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessageParam,
    ChoiceLogprobs,
)
from conduit_gateway.structured.constraints import Constraint, request_constraint
from conduit_gateway.structured.tools import ToolPlan, plan_tools

# Request fields naming OpenAI features this server does not have: any value but null (or the listed
# harmless one) is refused, so a client never silently gets less than it asked for.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "functions": (),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
}
_SERVICE_TIERS = ("auto", "default")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class ChatHandler(ChunkedHandler):
    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    body: ChatCompletionRequest
    tools: ToolPlan  # set by build_inputs
    absent_prompt_logprobs = {"prompt_logprobs": True}

    def build_inputs(self) -> list[engine_pb2.GenerateRequest]:
        body = self.body
        for name, allowed in _UNSUPPORTED.items():
            value = getattr(body, name)
            if value is not None and value not in allowed:
                raise invalid_param(name, "is not supported by this server")
        if body.store:
            raise invalid_param("store", "stored completions are not supported by this server")
        if body.metadata:
            raise invalid_param("metadata", "only used with store, which is not supported by this server")
        if body.service_tier is not None and body.service_tier not in _SERVICE_TIERS:
            raise invalid_param("service_tier", f"must be one of {', '.join(_SERVICE_TIERS)}")
        if not body.messages:
            raise invalid_param("messages", "must not be empty")
        chat = engine_pb2.ChatInput(messages=[_message(i, m) for i, m in enumerate(body.messages)])
        if body.add_generation_prompt is not None:
            chat.add_generation_prompt = body.add_generation_prompt
        self.tools = plan_tools(
            body.tools, body.tool_choice, body.parallel_tool_calls, self.ctx.config.tool_call_parser
        )
        if self.tools.tools_json is not None:
            chat.tools_json = self.tools.tools_json
        return [engine_pb2.GenerateRequest(chat=chat)]

    def build_sampling(self) -> engine_pb2.SamplingParams:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid_param("top_logprobs", "requires logprobs to be true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens=self._max_tokens(), logprobs=("top_logprobs", logprobs))
        self.constraint = self._constraint()
        if self.constraint is not None:
            # With a reasoning parser the structure applies to the answer, after the reasoning ends.
            reasoning = self.ctx.config.reasoning_parser
            after = reasoning_parser_class(reasoning).end_tag if reasoning else None
            self.constraint.apply(params, after=after)
        parser = self._tool_parser_class()
        if parser is not None and parser.needs_special_tokens and body.skip_special_tokens is None:
            params.skip_special_tokens = False
        return params

    def _constraint(self) -> Constraint | None:
        requested = request_constraint(self.body)
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

    def _max_tokens(self) -> tuple[str, int | None]:
        body = self.body
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise invalid_param("max_completion_tokens", "set either max_tokens or max_completion_tokens")
            return "max_completion_tokens", body.max_completion_tokens
        return "max_tokens", body.max_tokens

    def param_aliases(self) -> dict[str, str]:
        return {
            "chat": "messages",
            "input": "messages",
            "prompt": "messages",
            "tools_json": "tools",
            "chat.tools_json": "tools",
            "max_tokens": self._max_tokens()[0],
            "logprobs": "top_logprobs",
        }

    def new_choice(self, index: int, prompt_index: int) -> ChatChoiceState:
        reasoning = self.ctx.config.reasoning_parser
        tools = self._tool_parser_class()
        output = ChatOutputParser(
            reasoning_parser_class(reasoning)() if reasoning else None,
            tools() if tools else None,
            max_calls=None if self.tools.parallel else 1,
        )
        return ChatChoiceState(index, output=output)

    def opening_choice(self, choice: ChoiceState) -> dict[str, Any] | None:
        # OpenAI sends the role alone in each choice's first delta.
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta_choice(
        self, choice: ChatChoiceState, text: str, logprobs: Sequence[engine_pb2.PositionLogprobs]
    ) -> dict[str, Any] | RawJson | None:
        output = choice.output
        if not output.parses:
            # Without parsers the text is the content as it comes (what feed() would return), in the
            # common delta below, written at once.
            if not text and not logprobs:
                return None
            return _content_delta(choice.index, text, logprobs)
        delta = delta_fields(output.feed(text))
        if not delta:
            if not logprobs:
                return None  # held back by a parser
            delta["content"] = ""
        if len(delta) == 1 and "content" in delta:
            return _content_delta(choice.index, delta["content"], logprobs)
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": {"content": _logprob_entries(logprobs), "refusal": None} if logprobs else None,
            "finish_reason": None,
        }

    def text_delta(self, choice: ChatChoiceState) -> tuple[str, str] | None:  # type: ignore[override]
        # Without parsers or logprobs, every text is content as it comes (delta_choice's first branch).
        if choice.output.parses or self.body.logprobs:
            return None
        return _content_parts(choice.index, "null")

    def flush_choice(self, choice: ChatChoiceState) -> dict[str, Any] | None:
        delta = delta_fields(choice.output.finish())
        if not delta:
            return None
        return {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def finish_choice(self, choice: ChatChoiceState) -> dict[str, Any]:
        reason = choice.final_finish_reason()
        return {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def response(self, choices: list[ChatChoiceState], usage: UsageTotals) -> ChatCompletion:
        wants_logprobs = bool(self.body.logprobs)
        for choice in choices:
            # The whole text parsed in one piece: the same split the streamed deltas add up to.
            choice.output.feed(choice.text())
            choice.output.finish()
        return ChatCompletion(
            **self.response_fields(usage),
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=message(choice.output),
                    logprobs=ChoiceLogprobs.model_validate({"content": _logprob_entries(choice.logprobs)})
                    if wants_logprobs
                    else None,
                    finish_reason=choice.final_finish_reason(),
                )
                for choice in choices
            ],
            prompt_logprobs=self._prompt_logprobs(0),
        )


def _message(index: int, message: ChatMessageParam) -> engine_pb2.ChatMessage:
    where = f"messages[{index}]"
    role = _ROLES.get(message.role)
    if role is None:
        raise invalid_param(f"{where}.role", f"role {message.role!r} is not supported; use tool messages")
    for name in ("audio", "function_call"):
        if getattr(message, name) is not None:
            raise invalid_param(f"{where}.{name}", "is not supported by this server")
    out = engine_pb2.ChatMessage(role=role, content=_content(where, message))
    if message.content is None and not (role == "assistant" and message.tool_calls):
        raise invalid_param(f"{where}.content", f"is required for role {message.role!r}")
    if message.name is not None:
        out.name = fields.text(f"{where}.name", message.name)
    for call_index, call in enumerate(message.tool_calls or ()):
        if role != "assistant":
            raise invalid_param(f"{where}.tool_calls", "only assistant messages carry tool calls")
        call_where = f"{where}.tool_calls[{call_index}]"
        out.tool_calls.append(
            engine_pb2.ToolCall(
                id=fields.text(f"{call_where}.id", call.id),
                type=call.type,
                function_name=fields.text(f"{call_where}.function.name", call.function.name),
                function_arguments=fields.text(f"{call_where}.function.arguments", call.function.arguments),
            )
        )
    if message.tool_call_id is not None:
        out.tool_call_id = fields.text(f"{where}.tool_call_id", message.tool_call_id)
    elif role == "tool":
        raise invalid_param(f"{where}.tool_call_id", "is required for role 'tool'")
    return out


def _content(where: str, message: ChatMessageParam) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return fields.text(f"{where}.content", content)
    texts = []
    for part_index, part in enumerate(content):
        part_where = f"{where}.content[{part_index}]"
        if part.type != "text":
            raise invalid_param(
                f"{part_where}.type", f"only 'text' content parts are supported, got {part.type!r}"
            )
        if part.text is None:
            raise invalid_param(f"{part_where}.text", "is required for a text part")
        texts.append(fields.text(f"{part_where}.text", part.text))
    # Text parts are joined with newlines, as vLLM does, so a template sees one string per message.
    return "\n".join(texts)


def _content_delta(index: int, content: str, logprobs: Sequence[engine_pb2.PositionLogprobs]) -> RawJson:
    """The common delta, written by hand: the JSON of delta_choice's dict shape for `{"content": ...}`."""
    shaped = f'{{"content":[{_logprob_entries_json(logprobs)}],"refusal":null}}' if logprobs else "null"
    before, after = _content_parts(index, shaped)
    return RawJson(f"{before}{json_string(content)}{after}")


def _content_parts(index: int, logprobs_json: str) -> tuple[str, str]:
    """The common delta's JSON before and after its content's JSON string."""
    return f'{{"index":{index},"delta":{{"content":', f'}},"logprobs":{logprobs_json},"finish_reason":null}}'


def _logprob_entries(logprobs: Sequence[engine_pb2.PositionLogprobs]) -> list[dict[str, Any]]:
    return [
        {
            **_top(position.token),
            "top_logprobs": [_top(alternative) for alternative in position.top],
        }
        for position in logprobs
    ]


def _logprob_entries_json(logprobs: Sequence[engine_pb2.PositionLogprobs]) -> str:
    """`_logprob_entries` as JSON, comma-separated, without building the dicts."""
    return ",".join(
        f'{{{_top_fields(position.token)},"top_logprobs":'
        f"[{','.join([f'{{{_top_fields(alternative)}}}' for alternative in position.top])}]}}"
        for position in logprobs
    )


def _top_fields(token: engine_pb2.TokenLogprob) -> str:
    """`_top(token)`'s JSON, without its braces."""
    text_json, utf8_json = token_text_json(token.text)
    return (
        f'"token":{text_json},"logprob":{float.__repr__(safe_logprob(token.logprob))},"bytes":[{utf8_json}]'
    )


def _top(token: engine_pb2.TokenLogprob) -> dict[str, Any]:
    return {
        "token": token.text,
        "logprob": safe_logprob(token.logprob),
        "bytes": list(token.text.encode("utf-8")),
    }
