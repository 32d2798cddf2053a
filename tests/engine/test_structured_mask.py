"""The step's bitmask (BitmaskBuilder) and its application (apply_grammar_mask, TorchOps.apply_token_bitmask):
only constrained rows are filled and masked; unconstrained rows are never touched; the sampler then
never picks a disallowed token, whatever the bias, temperature or seed."""

from __future__ import annotations

import math

import pytest
import torch

from conduit_engine.ops.torch_ops import TorchOps
from conduit_engine.sampling.grammar_mask import StepBitmask, apply_grammar_mask
from conduit_engine.sampling.metadata import build_sampling_metadata
from conduit_engine.sampling.plan import SamplingRow
from conduit_engine.sampling.sampler import Sampler
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.batch_mask import BitmaskBuilder
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from conduit_engine.structured.state import GrammarState
from tests.engine.support.structured_support import compile_spec, spell, stories_vocab

pytestmark = pytest.mark.unit

VOCAB = 512
DIGITS = "[0-9]{1,3}"


def _naive_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The definition, one token at a time."""
    out = logits.clone()
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[row, t] = -math.inf
    return out


@pytest.mark.parametrize("vocab", [37, 64, 100])
def test_torch_reference_matches_the_definition(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = [4, 0, 2]  # not in order
    want = _naive_mask(logits, bitmask, rows)
    got = logits.clone()
    TorchOps().apply_token_bitmask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, want)
    for untouched in (1, 3, 5):
        assert torch.equal(got[untouched], logits[untouched])


@pytest.fixture
def digit_states(stories_path):
    compiled = compile_spec(stories_path, StructuredSpec(StructuredKind.REGEX, text=DIGITS))
    return [compiled.new_state() for _ in range(3)]


def test_builder_fills_only_active_rows_and_reuses_its_buffers(stories_path, digit_states):
    builder = BitmaskBuilder(VOCAB)
    assert builder.build([]) is None
    done = digit_states[2]
    for token in spell(stories_vocab(stories_path), "1") + [2]:
        done.accept(token)  # terminated by EOS: nothing left to mask
    assert builder.build([(0, done)]) is None
    first = builder.build([(5, digit_states[0]), (1, digit_states[1]), (3, done)])
    assert first is not None and first.rows.tolist() == [5, 1] and tuple(first.bitmask.shape) == (2, 16)
    assert torch.equal(first.bitmask[0], first.bitmask[1])  # both at the start of the same grammar
    pointer = first.bitmask.data_ptr()
    second = builder.build([(0, digit_states[1])])
    assert second is not None and second.bitmask.data_ptr() == pointer  # same buffer, no allocation
    grown = builder.build([(i, digit_states[0]) for i in range(5)])
    assert grown is not None and grown.num_rows == 5


def test_unconstrained_rows_are_never_touched(stories_path, digit_states):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=gen)
    logits[2, 7] = float("nan")  # even a NaN in an unconstrained row stays bit for bit
    original = logits.clone()
    mask = BitmaskBuilder(VOCAB).build([(3, digit_states[0]), (1, digit_states[1])])
    apply_grammar_mask(logits, mask, TorchOps())
    for row in (0, 2):
        assert torch.equal(logits[row].view(torch.int32), original[row].view(torch.int32))
    digits = set(spell(stories_vocab(stories_path), "0123456789"))
    for row in (1, 3):
        allowed = set(torch.nonzero(logits[row] > -math.inf).flatten().tolist())
        assert allowed and allowed <= {
            t for t in range(VOCAB) if stories_vocab(stories_path).token_bytes[t].isdigit()
        }
        assert digits <= allowed
    apply_grammar_mask(logits, None, TorchOps())  # a step without constrained rows: nothing happens


def test_sampler_never_picks_a_disallowed_token(stories_path, digit_states):
    vocab = stories_vocab(stories_path)
    letter_a = spell(vocab, "a")[0]
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    logits[:, letter_a] = 50.0  # every row prefers "a"
    params = [
        SamplingParams(temperature=0.0, logit_bias={letter_a: 100.0}),
        SamplingParams(temperature=1.3, seed=5, logprobs=2),
        SamplingParams(temperature=0.0),  # unconstrained
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, presence_penalty=1.0),
    ]
    constrained = {0: digit_states[0], 1: digit_states[1], 3: digit_states[2]}
    mask = BitmaskBuilder(VOCAB).build(list(constrained.items()))
    apply_grammar_mask(logits, mask, TorchOps())
    rows = [SamplingRow(p, [1, letter_a], [letter_a], p.seed) for p in params]
    out = Sampler(seed=0)(logits, build_sampling_metadata(rows, VOCAB, logits.device))
    assert out.token_ids[2] == letter_a  # the unconstrained row keeps its choice
    for row, state in constrained.items():
        assert vocab.token_bytes[out.token_ids[row]].isdigit(), row
        assert state.accept(out.token_ids[row])
    assert out.logprobs[1] is not None and out.logprobs[1].logprob > -math.inf


def test_mask_needs_float32_logits(digit_states):
    mask = BitmaskBuilder(VOCAB).build([(0, digit_states[0])])
    with pytest.raises(ValueError, match="logits: grammar masking needs float32 logits"):
        apply_grammar_mask(torch.zeros(1, VOCAB, dtype=torch.float16), mask, TorchOps())
    empty = StepBitmask(torch.zeros((0, 16), dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    apply_grammar_mask(torch.zeros(1, VOCAB, dtype=torch.float16), empty, TorchOps())


def test_batched_fill_equals_one_row_at_a_time(stories_path, digit_states):
    vocab = stories_vocab(stories_path)
    for token in spell(vocab, "12"):
        digit_states[1].accept(token)  # rows at different places in the grammar
    for token in spell(vocab, "123"):
        digit_states[2].accept(token)  # complete: only EOS is left
    one_by_one = torch.zeros((3, 16), dtype=torch.int32)
    for row, state in enumerate(digit_states):
        state.fill_bitmask(one_by_one, row)
    batched = torch.full((4, 16), 7, dtype=torch.int32)
    GrammarState.fill_bitmasks(digit_states, batched)
    assert torch.equal(batched[:3], one_by_one)
    assert batched[3].tolist() == [7] * 16  # rows past the states are not written


def test_termination_follows_eos_through_rollback(stories_path, digit_states):
    state = digit_states[0]
    for token in spell(stories_vocab(stories_path), "7") + [2]:
        assert state.accept(token)
    assert state.is_terminated and not state.is_active
    state.rollback(1)
    assert not state.is_terminated and state.is_active and state.accepts_eos
    assert state.fork().accept(2) and not state.is_terminated
