"""The real stories260K model, greedy, masked step by step in one batch (structured_support.decode):
JSON schemas give documents that validate, regex/choice/grammar outputs match, max_tokens first gives
a length stop, and an unconstrained sequence in the batch keeps exactly its tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conduit_engine.models.tokenizer import ModelTokenizer
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.model_factory import greedy_with, load_hf
from tests.engine.support.structured_support import Choice, compile_spec, decode

pytestmark = pytest.mark.unit

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                "minItems": 1,
                "maxItems": 3,
            },
            "pet": {"anyOf": [{"$ref": "#/$defs/cat"}, {"type": "null"}]},
        },
        "required": ["tags", "pet"],
        "$defs": {
            "cat": {
                "type": "object",
                "properties": {"lives": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["lives"],
            }
        },
    },
    {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad"]},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "done": {"type": "boolean"},
        },
        "required": ["mood", "done"],
    },
]
REGEX = r"(yes|no), [a-z]{2,8}\."
CHOICES = ("Lily", "Tom", "Ben")
GRAMMAR = 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\ncolor ::= "red" | "blue"'


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return ModelTokenizer(stories_path)


def _state(folder, kind, **fields):
    spec = StructuredSpec(kind, **fields)
    return compile_spec(folder, spec).new_state(spec.after)


def test_constrained_and_unconstrained_sequences_in_one_batch(stories_path, tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    long = SamplingParams(temperature=0.0, max_tokens=120)
    choices = [
        Choice(_state(stories_path, StructuredKind.JSON_SCHEMA, text=json.dumps(s)), long) for s in SCHEMAS
    ]
    choices += [
        Choice(None),  # unconstrained, between the others
        Choice(_state(stories_path, StructuredKind.REGEX, text=REGEX)),
        Choice(_state(stories_path, StructuredKind.CHOICE, choices=CHOICES)),
        Choice(_state(stories_path, StructuredKind.GRAMMAR, text=GRAMMAR)),
    ]
    decode(stories_path, prompt, choices)
    for schema, choice in zip(SCHEMAS, choices, strict=False):
        assert choice.finished_by == "grammar", tokenizer.decode(choice.tokens)
        jsonschema.validate(json.loads(tokenizer.decode(choice.tokens)), schema)
    free, regex, choice, grammar = choices[3:]
    assert free.tokens == greedy_with(load_hf(stories_path), prompt, len(free.tokens))
    assert free.finished_by == "length" and len(free.tokens) == 64
    assert re.fullmatch(REGEX, tokenizer.decode(regex.tokens)), tokenizer.decode(regex.tokens)
    assert tokenizer.decode(choice.tokens) in CHOICES
    assert re.fullmatch(r"The (cat|dog) is (red|blue)\.", tokenizer.decode(grammar.tokens))
    for c in (regex, choice, grammar):
        assert c.finished_by == "grammar"


def test_max_tokens_first_gives_length_and_an_unfinished_document(stories_path, tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    schema = SCHEMAS[1]
    capped = Choice(_state(stories_path, StructuredKind.JSON_SCHEMA, text=json.dumps(schema)))
    capped.params = SamplingParams(temperature=0.0, max_tokens=6)
    decode(stories_path, prompt, [capped])
    assert capped.finished_by == "length" and len(capped.tokens) == 6
    assert not capped.state.accepts_eos
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(capped.tokens))


def test_structure_starts_after_the_reasoning_tag(stories_path, tokenizer):
    """The model never writes `</think>`; " girl", which its greedy story reaches after a few tokens,
    stands in for it: the text up to it is the free greedy text, and after it comes one of the choices."""
    prompt = tokenizer.encode("Once upon a time")
    gated = Choice(
        _state(stories_path, StructuredKind.CHOICE, choices=CHOICES, after=" girl"),
        SamplingParams(temperature=0.0, max_tokens=40),
    )
    decode(stories_path, prompt, [gated])
    text = tokenizer.decode(gated.tokens)
    free, _, answer = text.partition(" girl")
    assert gated.finished_by == "grammar", text
    assert free == tokenizer.decode(greedy_with(load_hf(stories_path), prompt, 8))[: len(free)]
    assert answer in CHOICES
