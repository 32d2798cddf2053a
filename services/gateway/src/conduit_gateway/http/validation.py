"""Turns FastAPI's request validation errors (bad JSON, wrong types, unknown fields) into an OpenAI 400."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conduit_gateway.errors import OpenAIError

# Pydantic inserts the tried union member into error locations (e.g. prompt → "list[int]" → 0);
# those tags are not request fields.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error(errors: Sequence[Any]) -> OpenAIError:
    """A 400 naming the first offending field as `param` (e.g. "messages[0].content")."""
    if not errors:
        return OpenAIError(400, "Invalid request body.")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return OpenAIError(
            400, f"Invalid JSON body: {first.get('msg', 'could not parse')}.", code="invalid_json"
        )
    if not loc:
        # A missing body, or one that is not a JSON object (also when Content-Type is not JSON).
        return OpenAIError(
            400,
            "The request body must be a JSON object (Content-Type: application/json).",
            code="invalid_json",
        )
    param = _param(loc)
    if kind == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    return OpenAIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param)


def _param(loc: Sequence[Any]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        text = str(part)
        if "[" in text or text in _UNION_TAGS:
            break
        path = f"{path}.{text}" if path else text
    return path or "body"
