"""GrammarState and the `after` gate: EOS only where the structure is complete, special and padding ids
never allowed, rollback/replay/fork give the same state, and the gate opens on the tag's bytes."""

from __future__ import annotations

import pytest
import torch

from conduit_engine.models.tokenizer import ModelTokenizer
from conduit_engine.structured.after_gate import AfterGate
from conduit_engine.structured.compiler import StructuredCompiler
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from conduit_engine.structured.vocabulary import GrammarVocab
from tests.engine.support.structured_support import compile_spec, spell, stories_vocab

pytestmark = pytest.mark.unit

SCHEMA = (
    '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}'
)
DOCUMENT = '{"a": 12, "b": "xy"}'
EOS = 2


def _mask(state, words: int = 16) -> torch.Tensor:
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    state.fill_bitmask(bitmask, 0)
    return bitmask[0]


def _allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


@pytest.fixture
def schema_state(stories_path):
    return compile_spec(stories_path, StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA)).new_state()


def test_eos_is_allowed_exactly_where_the_structure_is_complete(stories_path):
    digits = compile_spec(stories_path, StructuredSpec(StructuredKind.REGEX, text="[0-9]+")).new_state()
    vocab = stories_vocab(stories_path)
    assert not _allowed(_mask(digits), EOS) and not digits.accepts_eos
    for token in spell(vocab, "12"):
        assert digits.accept(token)
        assert _allowed(_mask(digits), EOS) and digits.accepts_eos
        assert not digits.is_finished  # more digits may follow
    assert digits.accept(EOS) and digits.is_terminated and digits.is_finished and not digits.is_active


def test_eos_bit_follows_a_json_document_token_by_token(stories_path, schema_state):
    tokens = spell(stories_vocab(stories_path), DOCUMENT)
    for i, token in enumerate(tokens):
        row = _mask(schema_state)
        assert _allowed(row, token)
        assert _allowed(row, EOS) == schema_state.accepts_eos == (i == len(tokens))
        assert schema_state.accept(token)
    row = _mask(schema_state)
    assert schema_state.accepts_eos and schema_state.is_finished  # a closed object: only EOS is left
    assert [t for t in range(512) if _allowed(row, t)] == [EOS]


def test_special_and_padding_ids_are_never_allowed(stories_path):
    vocab = GrammarVocab.from_tokenizer(ModelTokenizer(stories_path).hf, 520, [EOS])  # lm_head padded
    assert vocab.words == 17 and len(vocab.token_bytes) == 520
    compiler = StructuredCompiler(vocab)
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, text='{"type": "string"}')
    state = compiler.submit(spec).result(timeout=60).new_state()
    compiler.shutdown()
    assert state.accept(spell(vocab, '"')[0])  # inside a string: almost any text is allowed
    row = _mask(state, words=17)
    allowed = [t for t in range(520) if _allowed(row, t)]
    assert len(allowed) > 300 and EOS not in allowed  # an open string cannot end the output
    assert not {0, 1}.intersection(allowed)  # <unk>, <s>: special, never text
    assert not set(range(512, 520)).intersection(allowed)  # padding ids have no token
    smaller = GrammarVocab.from_tokenizer(ModelTokenizer(stories_path).hf, 500, [EOS])  # ids >= 500 dropped
    assert len(smaller.token_bytes) == 500 and smaller.words == 16


def test_vocabulary_checks_its_inputs(stories_path):
    tokenizer = ModelTokenizer(stories_path).hf
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarVocab.from_tokenizer(tokenizer, 512, [])
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarVocab.from_tokenizer(tokenizer, 512, [512])
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarVocab.from_tokenizer(tokenizer, 0, [EOS])


def _snapshot(state) -> tuple:
    return (_mask(state).tolist(), state.is_active, state.accepts_eos, state.is_finished, state.num_tokens)


def test_rollback_replay_and_fork_give_the_same_state(stories_path, schema_state):
    tokens = spell(stories_vocab(stories_path), DOCUMENT)
    for token in tokens[:6]:
        schema_state.accept(token)
    before = _snapshot(schema_state)
    for token in tokens[6:9]:
        assert schema_state.accept(token)
    after = _snapshot(schema_state)
    schema_state.rollback(3)
    assert _snapshot(schema_state) == before
    twin = schema_state.fork()
    for token in tokens[6:]:
        assert twin.accept(token)
    assert twin.is_finished and _snapshot(schema_state) == before  # the fork is independent
    assert schema_state.replay(tokens[:9]) and _snapshot(schema_state) == after
    with pytest.raises(ValueError, match=r"num_tokens: must be in \[0, 9\]"):
        schema_state.rollback(10)


def test_a_rejected_token_fails_the_state_until_it_is_rolled_back(stories_path, schema_state):
    vocab = stories_vocab(stories_path)
    assert schema_state.accept(spell(vocab, "{")[0])
    assert not schema_state.accept(spell(vocab, "}")[0])  # "a" is required
    assert schema_state.has_failed and not schema_state.is_active and schema_state.num_tokens == 1
    schema_state.rollback(1)
    assert not schema_state.has_failed and schema_state.is_active and schema_state.num_tokens == 0


def test_after_gate_opens_on_the_tag_spelled_over_several_tokens(stories_path):
    vocab = stories_vocab(stories_path)
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, text=SCHEMA, after="</think>")
    state = compile_spec(stories_path, spec).new_state(spec.after)
    thinking = spell(vocab, "Hmm. </think>")
    assert len(thinking) > 4  # "<", "/", "t", "h", "in", "k", ">" are separate pieces here
    for token in thinking[:-1]:
        assert state.accept(token) and not state.is_active and state.accepts_eos  # free text
    assert state.accept(thinking[-1]) and state.is_active and not state.accepts_eos
    answer = spell(vocab, DOCUMENT)
    for token in answer:
        assert state.accept(token)
    assert state.is_finished
    # Rolling back into the tag closes the gate again; replay re-derives it from the output tokens.
    state.rollback(len(answer) + 1)
    assert not state.is_active and state.num_tokens == len(thinking) - 1
    assert state.replay(thinking + answer) and state.is_finished


def test_after_gate_matches_bytes_across_and_inside_pieces():
    gate = AfterGate(b"</think>")
    assert [gate.feed(p) for p in (b"ok <", b"/th", b"ink")] == [False, False, False]
    assert gate.feed(b">{") and gate.is_open and gate.feed(b"anything")
    inside = AfterGate(b"</think>")
    assert inside.feed(b"a</think>b")
    near_miss = AfterGate(b"</think>")
    assert not any(near_miss.feed(p) for p in (b"</thi", b"nk", b" </think", b"X>"))
    split_char = AfterGate("é!".encode())  # a UTF-8 character split over byte-fallback tokens
    assert not split_char.feed(b"\xc3") and split_char.feed(b"\xa9!")
    copy = near_miss.copy()
    assert copy.feed(b"</think>") and not near_miss.is_open
    with pytest.raises(ValueError):
        AfterGate(b"")
