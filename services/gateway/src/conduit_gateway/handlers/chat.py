"""POST /v1/chat/completions: messages → GenerateRequest.chat, choices shaped as chat deltas and messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import invalid_param
from conduit_gateway.handlers import fields
from conduit_gateway.handlers.base import GenerationHandler
from conduit_gateway.handlers.choices import ChoiceState, UsageTotals, safe_logprob
from conduit_gateway.handlers.sampling import sampling_params
from conduit_gateway.schemas.chat import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChatMessageParam,
    ChoiceLogprobs,
)

# Request fields naming OpenAI features this server does not have: any value but null (or the listed
# harmless one) is refused, so a client never silently gets less than it asked for.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "tools": (),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
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


class ChatHandler(GenerationHandler):
    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    body: ChatCompletionRequest
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
        if body.response_format is not None and body.response_format.type != "text":
            raise invalid_param(
                "response_format", f"type {body.response_format.type!r} is not supported; use 'text'"
            )
        if not body.messages:
            raise invalid_param("messages", "must not be empty")
        chat = engine_pb2.ChatInput(messages=[_message(i, m) for i, m in enumerate(body.messages)])
        if body.add_generation_prompt is not None:
            chat.add_generation_prompt = body.add_generation_prompt
        return [engine_pb2.GenerateRequest(chat=chat)]

    def build_sampling(self) -> engine_pb2.SamplingParams:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid_param("top_logprobs", "requires logprobs to be true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return sampling_params(
            body,
            max_tokens=self._max_tokens(),
            logprobs=("top_logprobs", logprobs),
        )

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
            "max_tokens": self._max_tokens()[0],
            "logprobs": "top_logprobs",
        }

    def opening_choice(self, choice: ChoiceState) -> dict[str, Any] | None:
        # OpenAI sends the role alone in each choice's first delta.
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta_choice(
        self, choice: ChoiceState, text: str, logprobs: Sequence[engine_pb2.PositionLogprobs]
    ) -> dict[str, Any]:
        return {
            "index": choice.index,
            "delta": {"content": text},
            "logprobs": {"content": _logprob_entries(logprobs), "refusal": None} if logprobs else None,
            "finish_reason": None,
        }

    def finish_choice(self, choice: ChoiceState) -> dict[str, Any]:
        return {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason}

    def response(self, choices: list[ChoiceState], usage: UsageTotals) -> ChatCompletion:
        wants_logprobs = bool(self.body.logprobs)
        return ChatCompletion(
            **self.response_fields(usage),
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=ChatMessage(content=choice.text()),
                    logprobs=ChoiceLogprobs.model_validate({"content": _logprob_entries(choice.logprobs)})
                    if wants_logprobs
                    else None,
                    finish_reason=choice.finish_reason,
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


def _logprob_entries(logprobs: Sequence[engine_pb2.PositionLogprobs]) -> list[dict[str, Any]]:
    return [
        {
            **_top(position.token),
            "top_logprobs": [_top(alternative) for alternative in position.top],
        }
        for position in logprobs
    ]


def _top(token: engine_pb2.TokenLogprob) -> dict[str, Any]:
    return {
        "token": token.text,
        "logprob": safe_logprob(token.logprob),
        "bytes": list(token.text.encode("utf-8")),
    }
