"""JSON schemas for the real-stack structured-output tests: one per feature a schema can use (nested
objects, bounded arrays, enums, number ranges, optional fields, patterns, anyOf/oneOf, $ref, recursion,
formats, tuples, top-level arrays and enums). Strings and numbers are bounded so that the tiny model,
which would otherwise repeat digits or words until max_tokens, finishes each document."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 10}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


def _object(required: list[str] | None = None, **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }


_ADDRESS = _object(city=NAME, zip={"type": "string", "pattern": "^[0-9]{5}$"})
_PEOPLE = {"type": "array", "items": _object(name=NAME, age=AGE), "minItems": 1, "maxItems": 2}
_GRID_ROW = {"type": "array", "items": DIGIT, "minItems": 2, "maxItems": 2}

SCHEMAS: dict[str, Any] = {
    "flat": _object(name=NAME, age=AGE),
    "nested": _object(person=_object(name=NAME, address=_ADDRESS)),
    "array_bounds": _object(
        tags={"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}
    ),
    "exact_length_array": _object(pair={"type": "array", "items": AGE, "minItems": 2, "maxItems": 2}),
    "enums": _object(mood={"enum": ["happy", "sad", "angry"]}, size={"type": "string", "enum": ["S", "M"]}),
    "number_ranges": _object(
        score={"type": "number", "minimum": -1, "maximum": 1},
        temp={"type": "number", "minimum": 10.5, "maximum": 20},
    ),
    "exclusive_range": _object(n={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    "optional_fields": _object(["name"], name=NAME, nickname=NAME, age=AGE),
    "string_patterns": _object(
        code={"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        word={"type": "string", "pattern": "^[a-z]{1,8}$"},
    ),
    "any_of": _object(value={"anyOf": [DIGIT, {"type": "string", "maxLength": 5}, {"type": "null"}]}),
    "ref": {
        **_object(owner={"$ref": "#/$defs/person"}, friend={"$ref": "#/$defs/person"}),
        "$defs": {"person": _object(name=NAME, age=AGE)},
    },
    "recursive_ref": _object(name=NAME, child={"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
    "boolean_and_null": _object(done={"type": "boolean"}, note={"type": "null"}),
    "const": _object(kind={"const": "story"}, title=NAME),
    "array_of_objects": _object(people=_PEOPLE),
    "nested_arrays": _object(grid={**_GRID_ROW, "items": _GRID_ROW}),
    "one_of_disjoint": _object(
        pet={
            "oneOf": [
                {**_object(cat=NAME), "additionalProperties": False},
                {**_object(dog=NAME), "additionalProperties": False},
            ]
        }
    ),
    "closed_object": {**_object(a=AGE, b=AGE), "additionalProperties": False},
    "format_date": _object(day={"type": "string", "format": "date"}),
    "top_level_array": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3},
    "top_level_enum": {"enum": ["red", "green", "blue"]},
    "tuple": _object(point={"type": "array", "prefixItems": [AGE, NAME], "items": False, "minItems": 2}),
    "string_lengths": _object(word={"type": "string", "minLength": 3, "maxLength": 5}),
    "type_list": _object(x={"type": ["integer", "null"], "minimum": 0, "maximum": 50}),
    "single_all_of": {"allOf": [_object(name=NAME, age=AGE)]},
    "multiple_of": _object(n={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}),
}
