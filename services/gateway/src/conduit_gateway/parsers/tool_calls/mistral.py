"""mistral: Mistral's `[TOOL_CALLS]` token followed by a JSON array of
`{"name": ..., "arguments": {...}}` (a lone object is accepted too)."""

from __future__ import annotations

import secrets
import string

from conduit_gateway.parsers.tool_calls.json_format import JsonToolCallParser

_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolCallParser(JsonToolCallParser):
    name = "mistral"
    # [TOOL_CALLS] is a control token: it only reaches the text when special tokens are not skipped.
    needs_special_tokens = True
    start_markers = ("[TOOL_CALLS]",)

    def new_call_id(self) -> str:
        # Mistral's chat templates refuse tool call ids other than 9 letters or digits.
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
