"""A Message's content blocks built from a choice's parsed output (handlers' OutputDelta), and the stream
events that add up to them: `content_block_start`, `content_block_delta` (`thinking_delta`,
`signature_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`.

The non-streamed Message is the same builder fed the whole text at once, so both always agree. Blocks
follow the output: thinking first, then text and tool_use blocks in the order the model wrote them; a
block closes when a block of another kind (or another tool call) starts, and at the end.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from conduit_gateway.parsers.chat_output import OutputDelta

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

Event = tuple[str, dict[str, Any]]  # (event name, data); the data carries "type": the name


def sse(name: str, data: dict[str, Any]) -> str:
    """One Server-Sent Event in Anthropic's framing: an `event:` line and a `data:` line."""
    return f"event: {name}\ndata: {_dumps(data)}\n\n"


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a call id the parsers minted (call_... → toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def thinking_signature(thinking: str) -> str:
    """An opaque value for the thinking block's `signature` (clients must send it back unchanged; this
    gateway does not check it): a digest of the thinking text, not a proof of origin."""
    return "conduit-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


class MessageBlocks:
    """Feed parsed deltas with `add`, then `close()` once; `blocks` is the Message's content so far.

    `thinking`: show the reasoning as thinking blocks (the request enabled thinking); `omit_thinking`:
    send thinking blocks without their text (thinking.display "omitted")."""

    def __init__(self, thinking: bool, omit_thinking: bool = False) -> None:
        self._thinking = thinking
        self._omit_thinking = omit_thinking
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._arguments: dict[int, str] = {}  # block index → a tool_use block's JSON text so far
        self._thinking_text: dict[int, str] = {}

    @property
    def tool_uses(self) -> int:
        return sum(block["type"] == "tool_use" for block in self.blocks)

    def add(self, delta: OutputDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning and self._thinking:
            index = self._ensure("thinking", events)
            self._thinking_text[index] = self._thinking_text.get(index, "") + delta.reasoning
            if not self._omit_thinking:
                self.blocks[index]["thinking"] += delta.reasoning
                events.append(_delta(index, {"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            index = self._ensure("text", events)
            self.blocks[index]["text"] += delta.content
            events.append(_delta(index, {"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            if call.name is not None:
                self._close(events)
                block = {"type": "tool_use", "id": tool_use_id(call.id or ""), "name": call.name, "input": {}}
                self._start(block, events)
            if call.arguments and self._open is not None and self._open["type"] == "tool_use":
                index = len(self.blocks) - 1
                self._arguments[index] = self._arguments.get(index, "") + call.arguments
                events.append(_delta(index, {"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def close(self) -> list[Event]:
        events: list[Event] = []
        self._close(events)
        return events

    def _ensure(self, kind: str, events: list[Event]) -> int:
        """The index of the open block of `kind`, opening one (and closing another kind) if needed."""
        if self._open is None or self._open["type"] != kind:
            self._close(events)
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else None
            self._start(block or {"type": "text", "text": ""}, events)
        return len(self.blocks) - 1

    def _start(self, block: dict[str, Any], events: list[Event]) -> None:
        index = len(self.blocks)
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})
        )
        self.blocks.append(json.loads(json.dumps(block)))  # the event keeps the empty block it announced
        self._open = self.blocks[index]

    def _close(self, events: list[Event]) -> None:
        if self._open is None:
            return
        index = len(self.blocks) - 1
        block, self._open = self._open, None
        if block["type"] == "thinking":
            block["signature"] = thinking_signature(self._thinking_text.get(index, ""))
            events.append(_delta(index, {"type": "signature_delta", "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            block["input"] = _input_object(self._arguments.get(index, ""))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _input_object(arguments: str) -> dict[str, Any]:
    """A tool_use block's `input`: the arguments the model wrote, or {} when they were cut short (the
    stop_reason is then max_tokens) or are not an object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
