"""StructuredSpec validation, its cache key, and the proto mapping of the `structured` oneof."""

from __future__ import annotations

import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_common.structured import MAX_STRUCTURED_SPEC_BYTES
from conduit_engine.entrypoints.proto_mapping import request_from_pb, sampling_from_pb, structured_from_pb
from conduit_engine.errors import InvalidRequestError
from conduit_engine.structured.spec import MAX_SPEC_BYTES, StructuredKind, StructuredSpec
from tests.support.imports import assert_not_loaded

pytestmark = pytest.mark.unit

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}}'


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        ({"kind": StructuredKind.JSON_SCHEMA, "text": "  "}, "sampling.json_schema", "must not be empty"),
        ({"kind": StructuredKind.JSON_SCHEMA, "text": "{"}, "sampling.json_schema", "is not valid JSON"),
        ({"kind": StructuredKind.JSON_SCHEMA, "text": "[1]"}, "sampling.json_schema", "got list"),
        ({"kind": StructuredKind.REGEX, "text": ""}, "sampling.regex", "must not be empty"),
        ({"kind": StructuredKind.GRAMMAR, "text": ""}, "sampling.grammar", "must not be empty"),
        ({"kind": StructuredKind.CHOICE}, "sampling.choice", "at least one string"),
        ({"kind": StructuredKind.CHOICE, "choices": ["a", ""]}, "sampling.choice", "string 1 is empty"),
        ({"kind": StructuredKind.CHOICE, "choices": ["a"] * 1025}, "sampling.choice", "at most 1024"),
        ({"kind": StructuredKind.CHOICE, "choices": ["x"], "text": "y"}, "sampling.choice", "takes no text"),
        ({"kind": StructuredKind.REGEX, "text": "a", "choices": ["b"]}, "sampling.regex", "no choices"),
        ({"kind": StructuredKind.JSON_OBJECT, "after": ""}, "sampling.structured_after", "not be empty"),
        ({"kind": StructuredKind.JSON_OBJECT, "after": "x" * 257}, "sampling.structured_after", "256"),
    ],
)
def test_bad_specs_name_their_field(kwargs, field, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        StructuredSpec(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_size_limit_counts_utf8_bytes():
    # The gateway's limit: no spec passes one side and fails the other.
    assert MAX_SPEC_BYTES == MAX_STRUCTURED_SPEC_BYTES
    at_limit = "a" * (MAX_SPEC_BYTES - 2) + "é"  # 2 bytes: exactly the limit
    assert StructuredSpec(StructuredKind.REGEX, text=at_limit).text == at_limit
    with pytest.raises(
        InvalidRequestError, match=f"at most {MAX_SPEC_BYTES} bytes, got {MAX_SPEC_BYTES + 1}"
    ):
        StructuredSpec(StructuredKind.GRAMMAR, text=at_limit + "a")
    with pytest.raises(InvalidRequestError, match="in all"):
        half = MAX_SPEC_BYTES // 2
        StructuredSpec(StructuredKind.CHOICE, choices=["a" * half, "b" * (half + 1)])


def test_cache_key_is_what_the_compile_depends_on():
    schema = StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA)
    assert (
        schema.cache_key
        == StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA, after="</think>").cache_key
    )
    assert (
        schema.cache_key
        != StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA, any_whitespace=True).cache_key
    )
    assert schema.cache_key != StructuredSpec(StructuredKind.REGEX, text=SCHEMA).cache_key
    regex = StructuredSpec(StructuredKind.REGEX, text="[a-z]+")
    assert (
        regex.cache_key == StructuredSpec(StructuredKind.REGEX, text="[a-z]+", any_whitespace=True).cache_key
    )
    # choices are a list: ("a,b",) and ("a", "b") must not collide
    assert (
        StructuredSpec(StructuredKind.CHOICE, choices=["a,b"]).cache_key
        != StructuredSpec(StructuredKind.CHOICE, choices=["a", "b"]).cache_key
    )
    assert StructuredSpec(StructuredKind.CHOICE, choices=["a"]) == StructuredSpec(
        StructuredKind.CHOICE, choices=("a",)
    )


def _sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**fields)


def test_each_oneof_member_maps_to_a_spec():
    assert structured_from_pb(_sampling()) is None
    assert structured_from_pb(_sampling(json_schema=SCHEMA)) == StructuredSpec(
        StructuredKind.JSON_SCHEMA, SCHEMA
    )
    assert structured_from_pb(_sampling(json_object=True)) == StructuredSpec(StructuredKind.JSON_OBJECT)
    assert structured_from_pb(_sampling(regex="a+")) == StructuredSpec(StructuredKind.REGEX, "a+")
    assert structured_from_pb(_sampling(grammar='root ::= "x"')) == StructuredSpec(
        StructuredKind.GRAMMAR, 'root ::= "x"'
    )
    spec = structured_from_pb(
        _sampling(
            choice=pb.ChoiceList(choices=["yes", "no"]),
            structured_any_whitespace=True,
            structured_after="</think>",
        )
    )
    assert spec == StructuredSpec(
        StructuredKind.CHOICE, choices=("yes", "no"), any_whitespace=True, after="</think>"
    )
    assert sampling_from_pb(_sampling(regex="a+", temperature=0.5)).structured == StructuredSpec(
        StructuredKind.REGEX, "a+"
    )


def test_modifiers_without_a_constraint_are_refused():
    for name, value in (("structured_any_whitespace", False), ("structured_after", "</think>")):
        with pytest.raises(InvalidRequestError, match="applies only with a structured constraint") as err:
            structured_from_pb(_sampling(**{name: value}))
        assert err.value.field == f"sampling.{name}"


def test_request_mapping_names_a_bad_spec():
    bad = pb.GenerateRequest(text="hi", sampling=_sampling(json_schema="{nope"))
    with pytest.raises(InvalidRequestError, match="^sampling.json_schema: is not valid JSON"):
        request_from_pb(bad)
    empty_choice = pb.GenerateRequest(text="hi", sampling=_sampling(choice=pb.ChoiceList()))
    with pytest.raises(InvalidRequestError, match="^sampling.choice: must list at least one string"):
        request_from_pb(empty_choice)
    good = pb.GenerateRequest(text="hi", sampling=_sampling(regex="a+"))
    assert request_from_pb(good).params.structured.text == "a+"


def test_the_spec_keeps_the_engine_core_free_of_torch_and_the_backend():
    assert_not_loaded(
        "import conduit_engine.sampling_params, conduit_engine.core.scheduler, conduit_engine.structured",
        "torch",
        "xgrammar",
    )
