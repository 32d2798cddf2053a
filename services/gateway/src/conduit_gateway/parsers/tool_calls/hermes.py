"""hermes: Hermes 2 Pro / Qwen2.5 / Qwen3 style, each call in its own
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly after some text."""

from __future__ import annotations

from conduit_gateway.parsers.tool_calls.json_format import JsonToolCallParser


class HermesToolCallParser(JsonToolCallParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"
