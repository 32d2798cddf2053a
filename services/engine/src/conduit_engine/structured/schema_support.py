"""Which JSON Schema keywords the grammar backend enforces: a schema using one it would silently ignore is
refused (`unenforced_keyword`), so an output that ends with `stop` always validates against its schema.

Measured on xgrammar 0.2.8 by sampling documents through its masks and validating them with
`jsonschema`: it enforces type, properties, required, additionalProperties, items, prefixItems,
min/maxItems, enum, const, anyOf, $ref/$defs, pattern, min/maxLength, format, minimum/maximum (also
exclusive), multipleOf, min/maxProperties, patternProperties, propertyNames and a one-schema allOf.
It ignores the keywords below (an `allOf` of several schemas only logs a warning; `contains` even
forces an empty array), so their documents may not validate. Some keywords also shadow others: a
string's `pattern` or `format` makes it ignore `minLength`/`maxLength`, and `enum` or `const` make it
ignore every value constraint beside them (`maximum`, `pattern`, ...). `oneOf` is enforced as `anyOf`: a
document matching two branches is possible when the branches overlap (disjoint unions, as pydantic
writes them, are exact).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
_LENGTHS = ("minLength", "maxLength")
_VALUE_CONSTRAINTS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    *_LENGTHS,
    "pattern",
    "format",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
)
# (keywords, the keywords they make the backend ignore, what to write instead)
_SHADOWING = (
    (("enum", "const"), _VALUE_CONSTRAINTS, "list only the allowed values"),
    (("pattern", "format"), _LENGTHS, "write the length into a pattern"),
)
# Keywords whose value is a schema, a list of schemas, or a name → schema map.
_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "additionalItems")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_keyword(schema: Any) -> str | None:
    """Why the backend cannot enforce `schema` (its first such keyword and where), or None."""
    for path, node in _subschemas(schema, "$"):
        reason = _ignored(node) or _shadowed(node)
        if reason is not None:
            keyword, why = reason
            return f"uses {keyword!r} (at {path}){why}"
    return None


def string_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """(location, pattern) of every string `pattern` in `schema`."""
    for path, node in _subschemas(schema, "$"):
        if isinstance(node.get("pattern"), str):
            yield path, node["pattern"]


def _ignored(node: dict[str, Any]) -> tuple[str, str] | None:
    ignored = ", which the grammar backend does not enforce"
    for keyword in _UNENFORCED:
        if keyword in node:
            return keyword, ignored
    if node.get("uniqueItems") is True:
        return "uniqueItems", ignored
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "allOf", f" with {len(all_of)} schemas; the grammar backend enforces one: merge them"
    return None


def _shadowed(node: dict[str, Any]) -> tuple[str, str] | None:
    for shadowing_keywords, shadowed_keywords, advice in _SHADOWING:
        for shadowing in shadowing_keywords:
            if shadowing not in node:
                continue
            for keyword in shadowed_keywords:
                if keyword in node:
                    why = f" with {shadowing!r}; the grammar backend enforces only the {shadowing}"
                    return keyword, f"{why}: {advice}"
    return None


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in `node` with its JSONPath-like location; data (enum, const) is skipped."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _ONE:
        yield from _subschemas(node.get(key), f"{path}.{key}")
    for key in _MANY:
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _subschemas(child, f"{path}.{key}[{i}]")
    items = node.get("items")
    if isinstance(items, list):  # draft 7 tuples
        for i, child in enumerate(items):
            yield from _subschemas(child, f"{path}.items[{i}]")
    for key in _NAMED:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _subschemas(child, f"{path}.{key}.{name}")
