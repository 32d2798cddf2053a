"""StructuredCompiler: worker-thread compiles, the spec cache, field-named compile errors, whitespace."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conduit_engine.errors import InvalidRequestError
from conduit_engine.structured.compiler import StructuredCompiler
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.structured_support import spell, stories_vocab

pytestmark = pytest.mark.unit

SCHEMA = '{"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}'


@pytest.fixture
def compiler(stories_path):
    compiler = StructuredCompiler(stories_vocab(stories_path), cache_size=2)
    yield compiler
    compiler.shutdown()


def _accepts(compiled, text: str) -> bool:
    """Whether the grammar matches `text` completely (tokenized by the real tokenizer)."""
    state = compiled.new_state()
    return state.replay(spell(compiled.vocab, text)) and state.accepts_eos


def test_compile_runs_on_a_worker_thread_and_returns_a_future(compiler, monkeypatch):
    seen = []
    real = compiler._compile_grammar

    def recording(spec):
        seen.append(threading.current_thread())
        return real(spec)

    monkeypatch.setattr(compiler, "_compile_grammar", recording)
    future = compiler.submit(StructuredSpec(StructuredKind.REGEX, text="[0-9]+"))
    compiled = future.result(timeout=60)
    assert len(seen) == 1
    assert seen[0] is not threading.current_thread()
    assert seen[0].name.startswith("conduit-grammar")
    assert _accepts(compiled, "123") and not _accepts(compiled, "12a")


def test_cache_hit_returns_the_same_compiled_object(compiler):
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA)
    first = compiler.submit(spec).result(timeout=60)
    assert compiler.submit(spec).result(timeout=60) is first
    # `after` only gates each sequence; the grammar is shared
    gated = StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA, after="</think>")
    assert compiler.submit(gated).result(timeout=60) is first
    assert asyncio.run(compiler.compiled(spec)) is first


def test_cache_is_bounded_least_recently_used_first(compiler):
    a, b, c = (StructuredSpec(StructuredKind.CHOICE, choices=[name]) for name in "abc")
    first_a = compiler.submit(a).result(timeout=60)
    compiler.submit(b).result(timeout=60)
    compiler.submit(a).result(timeout=60)  # a is now the most recent
    compiler.submit(c).result(timeout=60)  # cache_size=2: b goes
    assert compiler.cached(a) and compiler.cached(c) and not compiler.cached(b)
    assert compiler.submit(a).result(timeout=60) is first_a


@pytest.mark.parametrize(
    "spec, field, reason",
    [
        (StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"type": "objectx"}'), "sampling.json_schema",
         'Unsupported type "objectx"'),
        (StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"$ref": "#/$defs/nope"}'), "sampling.json_schema",
         "Cannot find field $defs in #/$defs/nope"),
        (StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"type": "integer", "minimum": 5, "maximum": 1}'),
         "sampling.json_schema", "Invalid range: minimum greater than maximum"),
        (StructuredSpec(StructuredKind.REGEX, text="a(b"), "sampling.regex",
         "Regex parsing error at position 4: The parenthesis is not closed."),
        (StructuredSpec(StructuredKind.GRAMMAR, text="root ::= foo"), "sampling.grammar",
         'EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ],
)  # fmt: skip
def test_compile_errors_name_the_field_and_the_backend_reason(compiler, spec, field, reason):
    future = compiler.submit(spec)
    with pytest.raises(InvalidRequestError) as err:
        future.result(timeout=60)
    assert err.value.field == field
    assert str(err.value) == f"{field}: does not compile: {reason}"
    assert "/project/" not in str(err.value)  # the backend's C++ source location is stripped
    assert not compiler.cached(spec)  # failures are not kept


@pytest.mark.parametrize(
    "spec, field, words",
    [
        # Compiles to `root ::= root`: no token can begin the output.
        (StructuredSpec(StructuredKind.GRAMMAR, text="root ::= root"), "sampling.grammar",
         "admits no output: no token can begin it"),
        (StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"$ref": "#"}'), "sampling.json_schema",
         "has no finite instance"),
        (StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": '
                        '"#/$defs/a"}'), "sampling.json_schema", "has no finite instance"),
        (StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"type": "object", "properties": {"n": {"$ref": '
                        '"#"}}, "required": ["n"]}'), "sampling.json_schema", "has no finite instance"),
        (StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"type": "object", "properties": {"s": {"type": '
                        '"string", "pattern": "^[^\\\\s\\\\S]$"}}, "required": ["s"]}'),
         "sampling.json_schema", "pattern '^[^\\\\s\\\\S]$' (at $.properties.s) matches no string"),
    ],
)  # fmt: skip
def test_specs_that_admit_no_output_name_the_field(compiler, spec, field, words):
    future = compiler.submit(spec)
    with pytest.raises(InvalidRequestError) as err:
        future.result(timeout=60)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: {words}")
    assert not compiler.cached(spec)


def test_json_whitespace_is_limited_by_default(compiler):
    strict = compiler.submit(StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA)).result(timeout=60)
    loose = compiler.submit(
        StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA, any_whitespace=True)
    ).result(timeout=60)
    assert _accepts(strict, '{"age": 7}')
    for text in ('{\n"age": 7}', '{"age":\n7}', '{ "age": 7}', '{"age":7}'):
        assert not _accepts(strict, text), text
        assert _accepts(loose, text), text


def test_json_object_and_choices_compile_exactly(compiler):
    obj = compiler.submit(StructuredSpec(StructuredKind.JSON_OBJECT)).result(timeout=60)
    assert _accepts(obj, '{"x": [1, "y"]}')
    assert not _accepts(obj, "[1]") and not _accepts(obj, '"text"')
    tricky = ('say "hi"', "back\\slash", "two\nlines", "ü")
    choice = compiler.submit(StructuredSpec(StructuredKind.CHOICE, choices=tricky)).result(timeout=60)
    for text in tricky:
        assert _accepts(choice, text), text
    assert not _accepts(choice, "say hi") and not _accepts(choice, "two")


def test_a_cancelled_waiter_does_not_cancel_the_shared_compile(compiler, monkeypatch):
    """One worker is held busy, so the second spec's compile is still queued when a waiter goes away."""
    release = threading.Event()
    real = compiler._compile_grammar

    def held(spec):
        if spec.kind is StructuredKind.GRAMMAR:
            release.wait(timeout=60)
        return real(spec)

    monkeypatch.setattr(compiler, "_compile_grammar", held)
    blocker = compiler.submit(StructuredSpec(StructuredKind.GRAMMAR, text='root ::= "x"'))
    spec = StructuredSpec(StructuredKind.REGEX, text="[a-z]+")

    async def scenario():
        leaving = asyncio.ensure_future(compiler.compiled(spec))
        staying = asyncio.ensure_future(compiler.compiled(spec))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.sleep(0)
        release.set()
        return await staying, leaving.cancelled()

    compiled, cancelled = asyncio.run(scenario())
    assert cancelled and compiled is compiler.submit(spec).result(timeout=60)
    assert blocker.result(timeout=60) is not None
