"""conduit_common.schema_instances: which JSON schemas have a finite instance (the least fixpoint over
$ref, anyOf/oneOf/allOf, required properties and array minimums), and that it stays linear on long chains."""

from __future__ import annotations

import pytest

from conduit_common.schema_instances import infinite_instance_problem

pytestmark = pytest.mark.unit

NODE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "required": ["v", "next"],
}


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        {"type": "object", "properties": {"x": False}, "required": ["x"]},
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {"type": "array", "prefixItems": [{"enum": []}], "minItems": 1},
        {"anyOf": [{"$ref": "#"}, False]},
        {"enum": []},
        False,
        {"type": "object", "required": ["x"], "additionalProperties": False},
        {"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}},
        {"type": "string", "const": 1},
        {"type": "integer", "enum": ["a", None, 1.5]},
        {"type": ["string", "null"], "enum": [1, 2]},
    ],
)
def test_schemas_without_finite_instance(schema):
    assert infinite_instance_problem(schema).startswith("has no finite instance")


@pytest.mark.parametrize(
    "schema",
    [
        True,
        {},
        {"type": "string"},
        {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
        {"type": "object", "properties": {"n": {"$ref": "#"}}},  # optional recursion ends
        {"type": "array", "items": {"$ref": "#"}},  # [] is an instance
        {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        {"type": "object", "properties": {"a/b": {"type": "string"}}, "required": ["a/b"]},
        {"$ref": "#/$defs/missing"},  # a dangling ref is the compiler's (or the gateway's) to report
        {"enum": [1], "properties": {"x": False}, "required": ["x"]},  # not an object schema: 1 is valid
        {"type": "object", "required": ["x"]},  # x may be anything
        {
            "type": "object",
            "required": ["x1"],
            "additionalProperties": False,
            "patternProperties": {"^x": {}},
        },
        {"type": "integer", "enum": ["a", 2.0]},
        {"type": ["string", "null"], "const": None},
        {"type": "number", "const": 1},
    ],
)
def test_schemas_with_a_finite_instance(schema):
    assert infinite_instance_problem(schema) is None


def test_a_long_ref_chain_is_followed_to_its_end():
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(20_000)}
    defs["d20000"] = {"type": "string"}
    assert infinite_instance_problem({"$defs": defs, "$ref": "#/$defs/d0"}) is None
    defs["d20000"] = {"$ref": "#/$defs/d0"}
    assert infinite_instance_problem({"$defs": defs, "$ref": "#/$defs/d0"}) is not None
