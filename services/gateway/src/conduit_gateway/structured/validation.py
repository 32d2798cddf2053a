"""Early checks of structured-output specs, each failing with a 400 naming the request field.

The engine has the final word (its grammar compiler); these catch what the gateway can see without one:
JSON schemas against their meta-schema (the `jsonschema` package), local `$ref`s that point nowhere,
schemas with no finite instance (`$ref` cycles: conduit_common.schema_instances),
regexes Python's `re` cannot compile, and specs over the size limit shared with the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import exceptions, validators

from conduit_common.schema_instances import infinite_instance_problem
from conduit_common.structured import MAX_STRUCTURED_SPEC_BYTES
from conduit_gateway.errors import invalid_param
from conduit_gateway.handlers import fields

# Keys whose values are data, not schemas: a `$ref` in them is not a reference.
DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


def check_size(param: str, spec: str, what: str = "") -> str:
    size = len(fields.text(param, spec).encode("utf-8"))
    if size > MAX_STRUCTURED_SPEC_BYTES:
        raise invalid_param(
            param, f"{what or 'the spec'} is {size} bytes, over the limit of {MAX_STRUCTURED_SPEC_BYTES}"
        )
    return spec


def json_schema_text(param: str, value: dict[str, Any] | str) -> str:
    """A JSON schema given as an object or as JSON text → its checked JSON text."""
    if isinstance(value, str):
        check_size(param, value)
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid_param(param, f"is not valid JSON: {exc}") from None
    check_json_schema(param, value)
    return check_size(param, fields.text(param, json.dumps(value, ensure_ascii=False, separators=(",", ":"))))


def check_json_schema(param: str, schema: object) -> None:
    """Raise a 400 naming `param` unless `schema` is a valid JSON Schema (draft 2020-12 unless it says)."""
    if not isinstance(schema, dict | bool):
        raise invalid_param(param, "must be a JSON schema (an object)")
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):
        raise invalid_param(param, "$schema must be a string")
    validator = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except exceptions.SchemaError as exc:
        raise invalid_param(
            param, f"is not a valid JSON schema: {exc.message} (at {exc.json_path})"
        ) from None
    except RecursionError:
        raise invalid_param(param, "is nested too deeply") from None
    _check_refs(param, schema, schema)
    try:
        problem = infinite_instance_problem(schema)
    except RecursionError:
        problem = "is nested too deeply"
    if problem is not None:
        raise invalid_param(param, problem)


def _check_refs(param: str, root: object, node: object, depth: int = 0) -> None:
    """Every `$ref` is local (`#...`) and points at something in the schema."""
    if depth > 200:
        raise invalid_param(param, "is nested too deeply")
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and _resolve(root, ref) is None:
            raise invalid_param(param, f"$ref {ref!r} does not point into the schema (only local refs work)")
        children = (value for key, value in node.items() if key not in DATA_KEYS)
    elif isinstance(node, list):
        children = iter(node)
    else:
        return
    for child in children:
        _check_refs(param, root, child, depth + 1)


_MISSING = object()


def _resolve(root: object, ref: str) -> object | None:
    if not ref.startswith("#"):
        return None
    node = root
    pointer = ref[1:]
    if not pointer:
        return node
    if not pointer.startswith("/"):
        return None  # an anchor name: resolved by nothing here
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(token, _MISSING)
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
        if node is _MISSING:
            return None
    return node


def check_regex(param: str, pattern: str) -> str:
    check_size(param, pattern)
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise invalid_param(param, f"is not a valid regular expression: {exc}") from None
    return pattern


def check_choice(param: str, choices: list[str]) -> list[str]:
    if not choices:
        raise invalid_param(param, "must list at least one string")
    for position, choice in enumerate(choices):
        if not choice:
            raise invalid_param(param, f"choice {position} is empty")
    check_size(param, "".join(choices), "the choices")
    return choices


def check_grammar(param: str, grammar: str) -> str:
    if not grammar.strip():
        raise invalid_param(param, "must not be empty")
    return check_size(param, grammar)
