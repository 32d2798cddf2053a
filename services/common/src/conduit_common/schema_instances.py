"""Whether a JSON schema has a finite instance, as far as `$ref`s, required properties and array minimums
decide it: `{"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}` compiles,
but every document it allows nests forever, so a request with it can only run into `max_tokens`.

A schema is productive when some finite document satisfies it: a `$ref` when its target is, an `anyOf` /
`oneOf` when one branch is, an `allOf` when all are, an object when every required property it defines
is (for one it does not define: `additionalProperties`, which `false` makes impossible), an array when
the items its `minItems` demands are. `false`, an empty `enum`, and an `enum` or `const` none of whose
values has the schema's `type` are not (the grammar backend would emit the value whatever `type` says).
Anything else counts as productive (other contradictions are the grammar compiler's to find). The least
fixpoint is computed with a worklist, so a long `$ref` chain costs linear time.

The gateway checks every request schema with it (a 400 naming the field); the engine checks again before
it compiles, for callers of its gRPC API.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "additionalItems")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def infinite_instance_problem(schema: Any) -> str | None:
    """Why `schema` has no finite instance, or None when it may have one."""
    nodes = dict(_schemas(schema, "#"))
    needs = {pointer: _needs(pointer, node, nodes) for pointer, node in nodes.items()}
    dependents: dict[str, set[str]] = defaultdict(set)
    for pointer, need in needs.items():
        for _, children in need:
            for child in children:
                dependents[child].add(pointer)
    productive: set[str] = set()
    work = list(nodes)
    while work:
        pointer = work.pop()
        if pointer in productive or not _satisfied(needs[pointer], productive):
            continue
        productive.add(pointer)
        work.extend(dependents[pointer] - productive)
    if "#" in productive:
        return None
    return (
        "has no finite instance: no document satisfies it (it requires a `false` schema or an empty "
        "`enum`, or a cycle through $ref, required properties or minItems)"
    )


# A node's needs: (mode, pointers) pairs that must all hold; mode "all" needs every pointer productive,
# "any" at least one; a node that can never be satisfied needs ("any", ()).
Need = tuple[str, tuple[str, ...]]


def _needs(pointer: str, node: Any, nodes: dict[str, Any]) -> list[Need]:
    if node is False:
        return [("any", ())]
    if not isinstance(node, dict):
        return []
    needs: list[Need] = []
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref.rstrip("/") in nodes:
        needs.append(("all", (ref.rstrip("/"),)))
    if not _some_value_has_the_type(node):
        needs.append(("any", ()))
    for key, mode in (("anyOf", "any"), ("oneOf", "any"), ("allOf", "all")):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            needs.append((mode, tuple(f"{pointer}/{key}/{i}" for i in range(len(branches)))))
    if node.get("type") == "object":
        needs.extend(_required_properties(pointer, node))
    if node.get("type") == "array":
        needs.append(("all", _required_items(pointer, node)))
    return needs


def _required_properties(pointer: str, node: dict[str, Any]) -> list[Need]:
    """Each required property needs its schema: its `properties` entry, else `additionalProperties`
    (`false`: nothing can hold it), unless a `patternProperties` entry may match the name."""
    required = node.get("required")
    if not isinstance(required, list):
        return []
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    needs: list[Need] = []
    for name in required:
        if not isinstance(name, str):
            continue
        if name in properties:
            needs.append(("all", (f"{pointer}/properties/{_escape(name)}",)))
        elif "additionalProperties" in node and not node.get("patternProperties"):
            needs.append(("all", (f"{pointer}/additionalProperties",)))
    return needs


# JSON Schema type name → whether a JSON value (as Python reads it) has it.
_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _some_value_has_the_type(node: dict[str, Any]) -> bool:
    """False when `enum` is empty, or when neither an `enum` value nor the `const` has the node's `type`
    (the grammar backend emits the listed values whatever `type` says)."""
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    else:
        return True
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or not all(kind in _TYPES for kind in kinds):
        return bool(values)
    return any(_TYPES[kind](value) for value in values for kind in kinds)


def _required_items(pointer: str, node: dict[str, Any]) -> tuple[str, ...]:
    minimum = node.get("minItems", 0)
    if not isinstance(minimum, int) or minimum <= 0:
        return ()
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    items = [f"{pointer}/prefixItems/{i}" for i in range(min(minimum, len(prefix)))]
    if minimum > len(prefix) and "items" in node and not isinstance(node["items"], list):
        items.append(f"{pointer}/items")
    return tuple(items)


def _satisfied(needs: list[Need], productive: set[str]) -> bool:
    for mode, pointers in needs:
        if mode == "all" and not all(p in productive for p in pointers):
            return False
        if mode == "any" and not any(p in productive for p in pointers):
            return False
    return True


def _schemas(node: Any, pointer: str) -> Iterator[tuple[str, Any]]:
    """Every schema (object or boolean) in `node` with its JSON pointer; data (enum, const) is skipped."""
    if not isinstance(node, dict | bool):
        return
    yield pointer, node
    if isinstance(node, bool):
        return
    for key in _ONE:
        if key in node:
            yield from _schemas(node[key], f"{pointer}/{key}")
    for key in (*_MANY, "items"):
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from _schemas(child, f"{pointer}/{key}/{i}")
    for key in _NAMED:
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from _schemas(child, f"{pointer}/{key}/{_escape(name)}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
