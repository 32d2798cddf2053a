"""Constrained decoding through the whole in-process LLMEngine (admission, scheduler, model runner,
sampler, stop rules) on stories260K: unconstrained requests batched with constrained ones keep exactly
their tokens; masking composes with n > 1, seeds, logprobs, penalties and logit_bias; EOS comes only
where the grammar accepts; the KV cache is empty after every run (harness.run_to_completion)."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.harness import make_engine, run_to_completion
from tests.engine.support.structured_support import compile_spec
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.unit

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
JSON = StructuredSpec(StructuredKind.JSON_SCHEMA, text=json.dumps(SCHEMA))
LETTERS = r"[a-z]{3,6}"
PROMPT = list(PROMPT_IDS)
EOS = 2


@pytest.fixture(scope="module")
def engine(stories_path):
    return make_engine(stories_path, block_size=4, num_blocks=1024)


def run(engine, requests: dict[str, SamplingParams]) -> dict[tuple[str, int], object]:
    for rid, params in requests.items():
        engine.add_request(GenerationRequest(rid, params, token_ids=PROMPT))
    return run_to_completion(engine)


FREE = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0),
    "seeded": SamplingParams(max_tokens=40, temperature=1.0, seed=9, top_p=0.9),
    "penalised": SamplingParams(max_tokens=40, temperature=0.8, seed=3, presence_penalty=1.0, logprobs=3),
}


def test_unconstrained_requests_keep_their_tokens_in_a_constrained_batch(engine):
    alone = run(engine, FREE)
    constrained = {
        f"json{i}": SamplingParams(max_tokens=60, temperature=0.7 * (i % 2), seed=i, structured=JSON)
        for i in range(6)
    }
    constrained["regex"] = SamplingParams(
        max_tokens=20, structured=StructuredSpec(StructuredKind.REGEX, text=LETTERS)
    )
    mixed = run(engine, {**constrained, **FREE})
    for rid in FREE:
        assert mixed[(rid, 0)].token_ids == alone[(rid, 0)].token_ids, rid
        # Logprobs move in the last float bits with the batch's shape (the matmuls block differently),
        # constrained rows or not; the mask never touches these rows (test_structured_mask).
        for got, want in zip(_logprobs(mixed[(rid, 0)]), _logprobs(alone[(rid, 0)]), strict=True):
            assert got.top_ids == want.top_ids and got.logprob == pytest.approx(want.logprob, abs=1e-4)
    for rid in constrained:
        assert mixed[(rid, 0)].final.finish_reason == FinishReason.STOP, mixed[(rid, 0)].text
        if rid.startswith("json"):
            jsonschema.validate(json.loads(mixed[(rid, 0)].text), SCHEMA)


def _logprobs(collected) -> list:
    return [entry for output in collected.outputs for entry in output.logprobs]


def test_n_choices_with_a_seed_each_validate_and_repeat(engine):
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=21, n=4, structured=JSON)
    first = run(engine, {"n4": params})
    again = run(engine, {"n4": params, **FREE})  # in a batch this time: seeds are per choice
    texts = [first[("n4", i)].text for i in range(4)]
    assert texts == [again[("n4", i)].text for i in range(4)]
    assert len(set(texts)) > 1  # each choice has its own seed
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_logprobs_penalties_and_logit_bias_compose_with_the_mask(engine, stories_path):
    vocab = compile_spec(stories_path, JSON).vocab
    quote = vocab.token_bytes.index(b'"')
    params = SamplingParams(
        max_tokens=80,
        temperature=0.9,
        seed=4,
        logprobs=5,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={quote: -100.0, EOS: 100.0},  # a needed token pushed away, a forbidden one pulled in
        structured=JSON,
    )
    out = run(engine, {"mixed": params})[("mixed", 0)]
    assert out.final.finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(out.text), SCHEMA)
    state = compile_spec(stories_path, JSON).new_state()
    entries = _logprobs(out)
    assert len(entries) == len(out.token_ids)
    for token, entry in zip(out.token_ids, entries, strict=True):
        assert math.isfinite(entry.logprob)
        # The top candidates are the grammar's: a masked token has -inf.
        for top_id, top_logprob in zip(entry.top_ids, entry.top_logprobs, strict=True):
            assert math.isinf(top_logprob) or state.fork().accept(top_id), (top_id, out.text)
        assert state.accept(token)


def test_eos_only_where_the_grammar_accepts(engine, stories_path):
    """logit_bias pulls EOS to +100: it comes at the first place the regex is complete, never before."""
    spec = StructuredSpec(StructuredKind.REGEX, text=LETTERS)
    out = run(
        engine,
        {"eos": SamplingParams(max_tokens=20, temperature=0.0, logit_bias={EOS: 100.0}, structured=spec)},
    )
    out = out[("eos", 0)]
    assert out.final.finish_reason == FinishReason.STOP and out.token_ids[-1] == EOS
    assert re.fullmatch(LETTERS, out.text)
    state = compile_spec(stories_path, spec).new_state()
    for token in out.token_ids[:-2]:
        state.accept(token)
        assert not state.accepts_eos  # complete earlier would have taken EOS earlier
    state.accept(out.token_ids[-2])
    assert state.accepts_eos


def test_min_tokens_and_ignore_eos_cannot_push_past_a_finished_structure(engine):
    spec = StructuredSpec(StructuredKind.CHOICE, choices=("Lily", "Tom"))
    params = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=20, ignore_eos=True, structured=spec)
    out = run(engine, {"choice": params})[("choice", 0)]
    assert out.text in ("Lily", "Tom") and out.final.finish_reason == FinishReason.STOP
