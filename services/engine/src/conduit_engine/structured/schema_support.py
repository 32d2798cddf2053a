"""Which JSON Schema keywords the grammar backend enforces: a schema using one it would silently ignore is
refused (`unenforced_keyword`), so an output that ends with `stop` always validates against its schema.

Measured on xgrammar 0.2.8 by sampling documents through its masks and validating them with
`jsonschema`: it enforces type, properties, required, additionalProperties, items, prefixItems,
min/maxItems, enum, const, anyOf, $ref/$defs, pattern, min/maxLength, format, minimum/maximum (also
exclusive), multipleOf, min/maxProperties, patternProperties, propertyNames and a one-schema allOf.
It ignores the keywords below (an `allOf` of several schemas only logs a warning; `contains` even
forces an empty array), so their documents may not validate. `oneOf` is enforced as `anyOf`: a
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
# Keywords whose value is a schema, a list of schemas, or a name → schema map.
_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "additionalItems")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_keyword(schema: Any) -> str | None:
    """Why the backend cannot enforce `schema` (its first such keyword and where), or None."""
    for path, node in _subschemas(schema, "$"):
        for keyword in _UNENFORCED:
            if keyword in node:
                return f"uses {keyword!r} (at {path}), which the grammar backend does not enforce"
        if node.get("uniqueItems") is True:
            return f"uses 'uniqueItems' (at {path}), which the grammar backend does not enforce"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return (
                f"uses 'allOf' with {len(all_of)} schemas (at {path}); the grammar backend enforces "
                "one; merge them into one schema"
            )
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
