"""JSON schemas using a keyword the grammar backend would ignore are refused naming the keyword and its
place, before any compile; the keywords it enforces pass."""

from __future__ import annotations

import json

import pytest

from conduit_engine.errors import InvalidRequestError
from conduit_engine.structured.compiler import StructuredCompiler
from conduit_engine.structured.schema_support import unenforced_keyword
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.structured_support import stories_vocab

pytestmark = pytest.mark.unit

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"not": {"type": "string"}}, "uses 'not' (at $)"),
        ({"type": "object", "if": {}, "then": {}}, "uses 'if' (at $)"),
        ({"type": "array", "contains": DIGIT}, "uses 'contains' (at $)"),
        ({"type": "array", "items": DIGIT, "uniqueItems": True}, "uses 'uniqueItems' (at $)"),
        (
            {"type": "object", "properties": {"a": DIGIT}, "dependentRequired": {"a": ["b"]}},
            "uses 'dependentRequired' (at $)",
        ),
        ({"allOf": [DIGIT, DIGIT]}, "uses 'allOf' (at $) with 2 schemas; the grammar backend enforces one"),
        (
            {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
            "uses 'maxLength' (at $) with 'pattern'; the grammar backend enforces only the pattern",
        ),
        ({"type": "string", "format": "date", "minLength": 3}, "uses 'minLength' (at $) with 'format'"),
        (
            {"enum": [1, 50], "maximum": 10},
            "uses 'maximum' (at $) with 'enum'; the grammar backend enforces only",
        ),
        ({"const": "abc", "pattern": "^a$"}, "uses 'pattern' (at $) with 'const'"),
        (
            {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
            "uses 'uniqueItems' (at $.properties.tags)",
        ),
        (
            {"$defs": {"p": {"anyOf": [DIGIT, {"not": DIGIT}]}}, "$ref": "#/$defs/p"},
            "uses 'not' (at $.$defs.p.anyOf[1])",
        ),
        ({"type": "array", "items": {"type": "array", "items": {"not": {}}}}, "(at $.items.items)"),
    ],
)
def test_unenforced_keywords_are_named_with_their_place(schema, reason):
    found = unenforced_keyword(schema)
    assert found is not None and reason in found


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [DIGIT]},
        {"type": "array", "items": DIGIT, "uniqueItems": False},
        {"type": "object", "properties": {"not": DIGIT, "if": DIGIT}, "required": ["not"]},  # names
        {"enum": [{"not": 1}]},  # data, not a schema
        {"const": {"contains": 2}},
        {"type": "object", "patternProperties": {"^x": DIGIT}, "propertyNames": {"pattern": "^x"}},
        {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30},
        {"oneOf": [{"type": "string"}, DIGIT]},
        {"type": "string", "enum": ["a", "b"], "title": "Letter", "description": "one letter"},
        {"type": "string", "pattern": "^[a-z]{1,8}$"},
        {"type": "string", "minLength": 1, "maxLength": 8},
        True,
    ],
)
def test_enforced_keywords_pass(schema):
    assert unenforced_keyword(schema) is None


def test_the_compiler_refuses_them_naming_the_field(stories_path):
    compiler = StructuredCompiler(stories_vocab(stories_path))
    try:
        spec = StructuredSpec(StructuredKind.JSON_SCHEMA, text=json.dumps({"not": {"type": "null"}}))
        with pytest.raises(InvalidRequestError) as err:
            compiler.submit(spec).result(timeout=60)
        assert str(err.value) == (
            "sampling.json_schema: uses 'not' (at $), which the grammar backend does not enforce"
        )
        assert not compiler.cached(spec)
    finally:
        compiler.shutdown()
