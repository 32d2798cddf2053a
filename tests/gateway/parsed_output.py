"""Helpers of the parser tests: run a parser over text split into deltas, and reassemble streamed chat
chunks into the message they add up to, checking OpenAI's streaming rules on the way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from conduit_gateway.parsers.chat_output import ChatOutputParser
from tests.gateway.sse import post_stream


def run_pieces(output: ChatOutputParser, pieces: Sequence[str]) -> dict[str, Any]:
    """Feed `pieces`, finish, and return the parsed message plus every delta (to check their order)."""
    deltas = [output.feed(piece) for piece in pieces]
    deltas.append(output.finish())
    calls: list[dict[str, str]] = []
    for delta in deltas:
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index == len(calls), "calls are announced in index order"
                assert call.id, "a call's first delta has its id"
                calls.append({"name": call.name, "arguments": ""})
            else:
                assert call.id is None and call.index < len(calls), "fragments follow their announcement"
            calls[call.index]["arguments"] += call.arguments
    streamed = {
        "reasoning": "".join(delta.reasoning for delta in deltas),
        "content": "".join(delta.content for delta in deltas),
        "tool_calls": calls,
    }
    # The parser's own record of the message is the same as what its deltas add up to.
    assert streamed == {
        "reasoning": output.reasoning,
        "content": output.content,
        "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in output.tool_calls],
    }
    return streamed


def every_split(text: str) -> list[list[str]]:
    """The text whole, cut at each single position, and one character per delta."""
    splits = [[text], list(text)]
    splits += [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    return splits


def reassemble_chat_stream(events: Sequence[dict | str]) -> dict[int, dict[str, Any]]:
    """Streamed chat chunks → per choice index the message they add up to and the finish reason.

    Checks on the way: a call's first entry has index, id, type and function.name (arguments ""
    or its first fragment); later entries of the call carry only index and arguments; calls start in
    index order; reasoning and reasoning_content always carry the same text.
    """
    assert events[-1] == "[DONE]"
    choices: dict[int, dict[str, Any]] = {}
    for chunk in events[:-1]:
        assert isinstance(chunk, dict) and "error" not in chunk, chunk
        for choice in chunk["choices"]:
            state = choices.setdefault(
                choice["index"], {"content": "", "reasoning": "", "tool_calls": [], "finish_reason": None}
            )
            _add_delta(state, choice["delta"])
            if choice["finish_reason"] is not None:
                assert state["finish_reason"] is None, "one finish per choice"
                state["finish_reason"] = choice["finish_reason"]
    return choices


def _add_delta(state: dict[str, Any], delta: dict[str, Any]) -> None:
    assert set(delta) <= {"role", "content", "reasoning", "reasoning_content", "tool_calls"}, delta
    assert delta.get("reasoning") == delta.get("reasoning_content")
    state["content"] += delta.get("content") or ""
    state["reasoning"] += delta.get("reasoning") or ""
    calls = state["tool_calls"]
    for entry in delta.get("tool_calls") or ():
        function = entry["function"]
        if entry["index"] == len(calls):
            assert entry["id"] and entry["type"] == "function" and function["name"], entry
            calls.append({"id": entry["id"], "name": function["name"], "arguments": ""})
        else:
            assert entry["index"] < len(calls) and set(entry) == {"index", "function"}, entry
            assert set(function) == {"arguments"}, entry
        calls[entry["index"]]["arguments"] += function["arguments"]


def message_view(message: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed message in the reassembled layout (null content and reasoning read as "")."""
    return {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning") or "",
        "tool_calls": [
            {"id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            for call in message.get("tool_calls") or ()
        ],
    }


def chat_streamed_and_not(http: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """POST a chat request twice, plain and streamed: (the non-streamed choice 0, its message in the
    reassembled layout). Asserts that the streamed deltas add up to the same message and finish reason
    (call ids aside: each request mints its own)."""
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    _, events = post_stream(http, "/v1/chat/completions", {**body, "stream": True})
    streamed = reassemble_chat_stream(events)[0]
    assert streamed.pop("finish_reason") == choice["finish_reason"]
    message = message_view(choice["message"])
    assert _without_call_ids(streamed) == _without_call_ids(message)
    return choice, message


def _without_call_ids(message: dict[str, Any]) -> dict[str, Any]:
    return {**message, "tool_calls": [{**call, "id": None} for call in message["tool_calls"]]}
