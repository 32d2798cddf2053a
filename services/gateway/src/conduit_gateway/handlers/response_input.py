"""Responses input items → the conversation the chat template renders, and back.

A conversation is a list of plain message dicts (role, content, tool_calls, tool_call_id), the form the
store keeps so that `previous_response_id` continues it: the earlier turns' input and output, then the
new input. `function_call` items become an assistant message's tool calls, `function_call_output` items
tool messages; `reasoning` items are dropped from the prompt, as OpenAI documents.
"""

from __future__ import annotations

from typing import Any

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import invalid_param
from conduit_gateway.handlers import fields
from conduit_gateway.handlers.response_events import item_id
from conduit_gateway.schemas.responses import ContentPartParam, InputItemParam

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}

Message = dict[str, Any]


def map_input(
    input_: str | list[InputItemParam], history: list[Message]
) -> tuple[list[Message], list[dict[str, Any]]]:
    """The new messages of this turn and the input items as stored (each with an id); 400 naming the
    item for anything not served. `history` is the chained conversation (its calls may be answered)."""
    if isinstance(input_, str):
        text = fields.text("input", input_)
        item = {
            "id": item_id("msg"),
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": text}],
        }
        return [{"role": "user", "content": text}], [item]
    if not input_:
        raise invalid_param("input", "must not be empty")
    calls = {call["id"] for message in history for call in message.get("tool_calls", ())}
    messages: list[Message] = []
    items: list[dict[str, Any]] = []
    for index, item in enumerate(input_):
        where = f"input[{index}]"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            role = _ROLES.get(item.role or "")
            if role is None:
                raise invalid_param(
                    f"{where}.role", f"must be one of user, assistant, system, developer, got {item.role!r}"
                )
            if item.content is None:
                raise invalid_param(f"{where}.content", "is required for a message")
            text = _text(f"{where}.content", item.content)
            messages.append({"role": role, "content": text})
            part_type = "output_text" if role == "assistant" else "input_text"
            stored: dict[str, Any] = {
                "id": item.id or item_id("msg"),
                "type": "message",
                "role": item.role,
                "status": item.status or "completed",
                "content": [{"type": part_type, "text": text}],
            }
            if part_type == "output_text":
                stored["content"][0]["annotations"] = []
            items.append(stored)
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if getattr(item, name) is None:
                    raise invalid_param(f"{where}.{name}", "is required for a function_call item")
            call = {
                "id": fields.text(f"{where}.call_id", item.call_id or ""),
                "name": fields.text(f"{where}.name", item.name or ""),
                "arguments": fields.text(f"{where}.arguments", item.arguments or ""),
            }
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            items.append(
                {
                    "id": item.id or item_id("fc"),
                    "type": "function_call",
                    "status": item.status or "completed",
                    "call_id": call["id"],
                    "name": call["name"],
                    "arguments": call["arguments"],
                }
            )
        elif kind == "function_call_output":
            if item.call_id is None:
                raise invalid_param(f"{where}.call_id", "is required for a function_call_output item")
            if item.call_id not in calls:
                raise invalid_param(
                    f"{where}.call_id",
                    f"No tool call found for function call output with call_id {item.call_id}.",
                )
            if item.output is None:
                raise invalid_param(f"{where}.output", "is required for a function_call_output item")
            output = _text(f"{where}.output", item.output)
            messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
            items.append(
                {
                    "id": item.id or item_id("fco"),
                    "type": "function_call_output",
                    "status": item.status or "completed",
                    "call_id": item.call_id,
                    "output": output,
                }
            )
        elif kind == "reasoning":
            continue  # not part of the prompt (OpenAI drops reasoning items of earlier turns too)
        else:
            raise invalid_param(
                f"{where}.type",
                f"input item type {kind!r} is not supported; use message, function_call, "
                "function_call_output or reasoning",
            )
    if not messages:
        raise invalid_param("input", "holds no message or function call to answer")
    return messages, items


def _text(where: str, content: str | list[ContentPartParam]) -> str:
    if isinstance(content, str):
        return fields.text(where, content)
    texts = []
    for index, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise invalid_param(f"{where}[{index}].type", f"only text parts are supported, got {part.type!r}")
        if part.text is None:
            raise invalid_param(f"{where}[{index}].text", "is required for a text part")
        texts.append(fields.text(f"{where}[{index}].text", part.text))
    return "\n".join(texts)


def output_messages(output: list[dict[str, Any]]) -> list[Message]:
    """A response's output as conversation messages: its text and calls as one assistant message."""
    content = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [
        {"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
        for item in output
        if item["type"] == "function_call"
    ]
    if not content and not calls:
        return []
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return [message]


def to_pb(message: Message) -> engine_pb2.ChatMessage:
    out = engine_pb2.ChatMessage(role=message["role"], content=message["content"])
    for call in message.get("tool_calls", ()):
        out.tool_calls.append(
            engine_pb2.ToolCall(
                id=call["id"],
                type="function",
                function_name=call["name"],
                function_arguments=call["arguments"],
            )
        )
    if "tool_call_id" in message:
        out.tool_call_id = message["tool_call_id"]
    return out
