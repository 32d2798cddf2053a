"""The Responses API's event writer: parsed output (reasoning, text, tool calls) becomes output items and
the typed stream events (`response.output_item.added`, `response.output_text.delta`, ...) with
increasing `sequence_number`; it also holds the response object those events describe."""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from conduit_gateway.errors import OpenAIError
from conduit_gateway.parsers.chat_output import OutputDelta

# The delta events of one item that a client reading slowly gets merged (their texts, and logprobs, joined).
_MERGED_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)

# The event that ends a response of each final status (a cancelled one just ends).
_TERMINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """Feed it the parsed deltas of the one choice, then `finish` once; `response` is the object."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.sequence = 0
        self._open: dict[str, Any] | None = None  # the output item being written

    @property
    def finished(self) -> bool:
        """Whether `finish` ran (the status is final)."""
        return self.response["status"] in ("completed", "incomplete", "failed", "cancelled")

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def snapshot(self) -> dict[str, Any]:
        """A copy of the response as it stands (events keep their own: the object keeps changing)."""
        return copy.deepcopy(self.response)

    def queued(self) -> list[dict[str, Any]]:
        return [self.event("response.queued", response=self.snapshot())]

    def opening(self) -> list[dict[str, Any]]:
        """`response.created` (unless a queued event already announced it) and `response.in_progress`."""
        self.response["status"] = "in_progress"
        events = [] if self.sequence else [self.event("response.created", response=self.snapshot())]
        return [*events, self.event("response.in_progress", response=self.snapshot())]

    def feed(self, delta: OutputDelta, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Events for one parsed delta; `logprobs` (of the tokens the delta came from) go with its text."""
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            item = self._ensure("reasoning", events)
            item["content"][0]["text"] += delta.reasoning
            events.append(self._text_event("response.reasoning_text.delta", delta=delta.reasoning))
        if delta.content:
            item = self._ensure("message", events)
            part = item["content"][0]
            part["text"] += delta.content
            part["logprobs"].extend(logprobs or ())
            events.append(
                self._text_event("response.output_text.delta", delta=delta.content, logprobs=logprobs or [])
            )
        for call in delta.tool_calls:
            if call.name is not None:
                self._close(events, "completed")
                self._add(
                    {
                        "id": item_id("fc"),
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": call.id or item_id("call"),
                        "name": call.name,
                        "arguments": "",
                    },
                    events,
                )
            if call.arguments and self._open is not None and self._open["type"] == "function_call":
                self._open["arguments"] += call.arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=len(self.output) - 1,
                        delta=call.arguments,
                    )
                )
        return events

    def finish(
        self,
        status: str,
        usage: dict[str, Any] | None,
        incomplete_reason: str | None = None,
        error: OpenAIError | None = None,
    ) -> list[dict[str, Any]]:
        """Close the open item and set the final status; the terminal event (none when cancelled)."""
        events: list[dict[str, Any]] = []
        self._close(events, "incomplete" if status in ("incomplete", "cancelled") else "completed")
        response = self.response
        response["status"] = status
        response["completed_at"] = int(time.time()) if status == "completed" else None
        response["usage"] = usage
        response["incomplete_details"] = (
            {"reason": incomplete_reason} if incomplete_reason is not None else None
        )
        if error is not None:
            response["error"] = {"code": error.code or error.type, "message": error.message}
        response["output_text"] = output_text(response["output"])
        terminal = _TERMINAL_EVENT.get(status)
        if terminal is not None:
            events.append(self.event(terminal, response=self.snapshot()))
        return events

    def merged(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`events`, the latest this writer made, with each run of consecutive delta events of one item
        as one event (texts concatenated, logprobs one entry per token as before), renumbered from the
        first one's `sequence_number` so that the stream's numbers stay contiguous."""
        if len(events) < 2:
            return events
        out: list[dict[str, Any]] = []
        grown: dict[int, dict[str, Any]] = {}  # id → an event that took others in (its own copy)
        for event in events:
            last = out[-1] if out else None
            if (
                last is None
                or event["type"] not in _MERGED_DELTAS
                or last["type"] != event["type"]
                or last["item_id"] != event["item_id"]
            ):
                out.append(event)
                continue
            if id(last) not in grown:
                last = {**last, "delta": [last["delta"]]}
                if "logprobs" in last:
                    last["logprobs"] = list(last["logprobs"])
                out[-1] = grown[id(last)] = last
            last["delta"].append(event["delta"])
            if "logprobs" in event:
                last["logprobs"].extend(event["logprobs"])
        for event in grown.values():
            event["delta"] = "".join(event["delta"])
        first = events[0]["sequence_number"]
        for offset, event in enumerate(out):
            event["sequence_number"] = first + offset
        self.sequence = first + len(out)
        return out

    def error_event(self, error: OpenAIError) -> dict[str, Any]:
        return self.event("error", code=error.code, message=error.message, param=error.param)

    # -- items -------------------------------------------------------------------------------------

    def _ensure(self, kind: str, events: list[dict[str, Any]]) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close(events, "completed")
        if kind == "message":
            item = {
                "id": item_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": item_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        self._add(item, events)
        item["content"].append(part)
        events.append(
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                part=copy.deepcopy(part),
            )
        )
        return item

    def _add(self, item: dict[str, Any], events: list[dict[str, Any]]) -> None:
        self.output.append(item)
        self._open = item
        events.append(
            self.event(
                "response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item)
            )
        )

    def _text_event(self, type_: str, **fields: Any) -> dict[str, Any]:
        assert self._open is not None
        return self.event(
            type_, item_id=self._open["id"], output_index=len(self.output) - 1, content_index=0, **fields
        )

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.output) - 1
        item["status"] = status
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            fields: dict[str, Any] = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                events.append(
                    self.event(
                        "response.output_text.done", **fields, text=part["text"], logprobs=part["logprobs"]
                    )
                )
            else:
                events.append(self.event("response.reasoning_text.done", **fields, text=part["text"]))
            events.append(self.event("response.content_part.done", **fields, part=copy.deepcopy(part)))
        events.append(self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))


def output_text(output: list[dict[str, Any]]) -> str:
    """The text of every output_text part, joined (the SDKs' `output_text`)."""
    return "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
