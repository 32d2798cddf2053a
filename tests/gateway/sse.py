"""Reading raw Server-Sent Events the way a strict client would: every event must be `data: ...\\n\\n`."""

from __future__ import annotations

import json

import httpx


def parse_events(body: str) -> list[dict | str]:
    """Split a complete SSE body into its data payloads: dicts for JSON, "[DONE]" as a string."""
    assert body.endswith("\n\n"), "an SSE body ends with a blank line"
    events: list[dict | str] = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: "), f"not a data event: {block!r}"
        assert "\n" not in block, f"one line per event: {block!r}"
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def post_stream(http: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, list[dict | str]]:
    response = http.post(path, json=body)
    assert response.headers["content-type"].startswith("text/event-stream"), response.text
    return response, parse_events(response.text)
