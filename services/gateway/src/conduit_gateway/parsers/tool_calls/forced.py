"""The output of `tool_choice: "required"` or a named function: the engine's grammar makes the whole
output JSON calls (see structured/tools.py for the schema), so it is read from its first character.
Not a `--tool-call-parser` value: the gateway picks it for those requests whatever the flag says."""

from __future__ import annotations

from conduit_gateway.parsers.tool_calls.json_format import JsonToolCallParser


class ForcedToolCallParser(JsonToolCallParser):
    bare_start = "{["
    argument_keys = ("arguments",)
