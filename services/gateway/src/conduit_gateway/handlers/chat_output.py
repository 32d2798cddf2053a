"""Chat choices as parsed output: each choice's ChatOutputParser and the OpenAI shapes built from it, the
streamed delta and the non-streamed message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conduit_gateway.handlers.choices import ChoiceState
from conduit_gateway.parsers.chat_output import ChatOutputParser, OutputDelta
from conduit_gateway.schemas.chat import ChatMessage, FunctionCall, ToolCall


@dataclass(slots=True)
class ChatChoiceState(ChoiceState):
    output: ChatOutputParser = field(default_factory=ChatOutputParser)

    def final_finish_reason(self) -> str | None:
        """The engine's reason, except that a reply that made tool calls and stopped says so."""
        if self.finish_reason == "stop" and self.output.tool_calls:
            return "tool_calls"
        return self.finish_reason


def delta_fields(parsed: OutputDelta) -> dict[str, Any]:
    """The `delta` of a chunk carrying `parsed`; empty when there is nothing to send."""
    delta: dict[str, Any] = {}
    if parsed.reasoning:
        delta["reasoning_content"] = delta["reasoning"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        delta["tool_calls"] = _tool_call_entries(parsed)
    return delta


def _tool_call_entries(parsed: OutputDelta) -> list[dict[str, Any]]:
    """One entry per call: its first carries id, type and name; fragments of one call are joined."""
    entries: dict[int, dict[str, Any]] = {}
    for call in parsed.tool_calls:
        entry = entries.get(call.index)
        if entry is None:
            entry = entries[call.index] = {"index": call.index}
            if call.name is not None:
                entry.update(id=call.id, type="function", function={"name": call.name, "arguments": ""})
            else:
                entry["function"] = {"arguments": ""}
        entry["function"]["arguments"] += call.arguments
    return list(entries.values())


def message(output: ChatOutputParser) -> ChatMessage:
    """The non-streamed message: content is null when the reply is only reasoning or tool calls."""
    calls = [
        ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in output.tool_calls
    ]
    content: str | None = output.content
    if not content and (calls or output.reasoning):
        content = None
    return ChatMessage(
        content=content,
        tool_calls=calls or None,
        reasoning_content=output.reasoning or None,
        reasoning=output.reasoning or None,
    )
