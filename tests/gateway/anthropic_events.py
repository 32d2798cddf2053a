"""Reading Anthropic's Server-Sent Events strictly: the framing (`event: NAME` then `data: {json}` whose
`type` is NAME) and the event grammar of a streamed Message, reassembled into the Message it adds up to."""

from __future__ import annotations

import json
from typing import Any

import httpx

# Which deltas each block type may carry.
_DELTAS = {
    "text": {"text_delta"},
    "tool_use": {"input_json_delta"},
    "thinking": {"thinking_delta", "signature_delta"},
}


def parse_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """A complete SSE body → [(event name, data)]."""
    assert body.endswith("\n\n"), "an SSE body ends with a blank line"
    events = []
    for block in body[:-2].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2, f"an event is one event: line and one data: line: {block!r}"
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, data = lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])
        assert data["type"] == name, block
        events.append((name, data))
    return events


def names(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in events]


def post_events(http: httpx.Client, body: dict[str, Any], **kwargs: Any) -> list[tuple[str, dict[str, Any]]]:
    response = http.post("/v1/messages", json={**body, "stream": True}, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_events(response.text)


def reassemble(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Check the grammar and return the Message the events add up to (tool_use input parsed).

    message_start first; then content blocks, each opened with the next index, carrying only its kind
    of delta, and stopped before the next opens; then one message_delta and message_stop last. ping may
    come anywhere after message_start. An `error` event ends the stream (it is returned as `error`).
    """
    assert events and events[0][0] == "message_start", names(events)
    message = dict(events[0][1]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    blocks: list[dict[str, Any]] = []
    json_text: dict[int, str] = {}
    open_index: int | None = None
    finished = False
    for position, (name, data) in enumerate(events[1:], start=1):
        if name == "ping":
            continue
        if name == "error":
            assert position == len(events) - 1, "an error event is the last"
            message["error"] = data["error"]
            return message
        assert not finished or name == "message_stop", names(events)
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks), names(events)
            open_index = data["index"]
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            assert data["index"] == open_index, names(events)
            block, delta = blocks[open_index], data["delta"]
            assert delta["type"] in _DELTAS[block["type"]], (block, delta)
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                json_text[open_index] = json_text.get(open_index, "") + delta["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index, names(events)
            if blocks[open_index]["type"] == "tool_use":
                blocks[open_index]["input"] = _input(json_text.get(open_index, ""))
            open_index = None
        elif name == "message_delta":
            assert open_index is None, "every block stops before message_delta"
            message.update(data["delta"])
            message["usage"] = {**message["usage"], **data["usage"]}
            finished = True
        elif name == "message_stop":
            assert finished and position == len(events) - 1, names(events)
        else:
            raise AssertionError(f"unknown event {name!r}")
    assert events[-1][0] == "message_stop", names(events)
    message["content"] = blocks
    return message


def _input(text: str) -> dict[str, Any]:
    """A tool_use block's input from its partial_json pieces; {} when max_tokens cut them short."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}
