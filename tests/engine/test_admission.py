"""Admission: each rule checked once when a request arrives, so that nothing a request carries can
fail a step (and with it every other running request)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import DuplicateRequestError, InvalidRequestError
from conduit_engine.models.tokenizer import ChatMessage
from conduit_engine.sampling_params import SamplingParams
from tests.engine.support.harness import greedy, make_engine, run_to_completion
from tests.engine.support.model_factory import make_tiny_model

pytestmark = pytest.mark.unit

EXTRA = "<extra>"


@pytest.fixture(scope="module")
def tokenizer_beyond_model(tmp_path_factory):
    """A tiny model whose tokenizer knows one token more than the model has embeddings for (as
    checkpoints with added tokens but an unresized embedding do)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("m") / "model")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    tok.add_special_tokens([EXTRA])
    assert tok.token_to_id(EXTRA) == vocab
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_a_prompt_outside_the_vocabulary_is_refused_and_running_requests_are_untouched(
    tokenizer_beyond_model, penalty
):
    alone = make_engine(tokenizer_beyond_model)
    alone.add_request(GenerationRequest("a", greedy(12), token_ids=[1, 40, 41]))
    expected = run_to_completion(alone)[("a", 0)].token_ids

    engine = make_engine(tokenizer_beyond_model)
    engine.add_request(GenerationRequest("a", greedy(12), token_ids=[1, 40, 41]))
    first = engine.step()  # "a" is running when the bad request arrives
    bad = GenerationRequest("b", SamplingParams(repetition_penalty=penalty), text=f"hi {EXTRA}")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(bad)
    assert err.value.field == "text" and "outside the vocabulary" in str(err.value)
    chat = [ChatMessage(role="user", content=EXTRA)]
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(GenerationRequest("c", SamplingParams(), messages=chat))
    assert err.value.field == "messages"
    result = run_to_completion(engine)
    assert [t for out in first for t in out.token_ids] + result[("a", 0)].token_ids == expected
    assert result[("a", 0)].final.finish_reason.value == "length" and len(expected) == 12
    assert set(result) == {("a", 0)}


def test_max_tokens_is_resolved_on_a_copy(stories_path):
    engine = make_engine(stories_path)
    params = SamplingParams(ignore_eos=True)
    engine.add_request(GenerationRequest("t", params, token_ids=[1]))
    assert params.max_tokens is None
    assert len(run_to_completion(engine)[("t", 0)].token_ids) == 16


def test_min_tokens_above_the_default_max_tokens_is_refused(stories_path):
    engine = make_engine(stories_path)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(GenerationRequest("t", SamplingParams(min_tokens=20), token_ids=[1]))
    assert err.value.field == "min_tokens"


def test_exactly_one_input(stories_path):
    engine = make_engine(stories_path)
    for kwargs in ({}, {"text": "hi", "token_ids": [1]}):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(GenerationRequest("x", SamplingParams(), **kwargs))
        assert err.value.field == "input"
    for kwargs, field in (({"text": ""}, "text"), ({"token_ids": []}, "token_ids")):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(GenerationRequest("x", SamplingParams(), **kwargs))
        assert err.value.field == field
    assert not engine.has_work()


def test_a_live_request_id_is_refused_until_it_finishes(stories_path):
    engine = make_engine(stories_path)
    engine.add_request(GenerationRequest("same", greedy(3), token_ids=[1]))
    with pytest.raises(DuplicateRequestError):
        engine.add_request(GenerationRequest("same", greedy(3), token_ids=[1]))
    run_to_completion(engine)
    engine.add_request(GenerationRequest("same", greedy(3), token_ids=[1]))
    assert len(run_to_completion(engine)[("same", 0)].token_ids) == 3
