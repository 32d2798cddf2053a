"""llama3_json: Llama 3.1/3.2 JSON tool calls, `{"name": ..., "parameters": {...}}` at the start of the
output or after `<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

from conduit_gateway.parsers.tool_calls.json_format import JsonToolCallParser


class Llama3JsonToolCallParser(JsonToolCallParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    separator = ";"
    bare_start = "{"
