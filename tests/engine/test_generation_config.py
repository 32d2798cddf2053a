"""generation_config.json: its EOS ids end generation; with --generation-config auto its sampling defaults
fill exactly the fields a request leaves unset, once, at admission."""

from __future__ import annotations

import json
import shutil

import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.entrypoints.proto_mapping import request_from_pb, sampling_from_pb
from conduit_engine.errors import ModelLoadError
from conduit_engine.sampling_params import MODEL_DEFAULTABLE, SamplingParams
from tests.engine.support.harness import generate, greedy, make_engine
from tests.support.stories import KNOWN_STORY

pytestmark = pytest.mark.unit

DEFAULTS = {"temperature": 0.0, "top_p": 0.8, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3}


@pytest.fixture
def model(tmp_path, stories_path):
    """stories260K with a generation_config.json: sampling defaults, max_new_tokens and extra EOS ids."""
    folder = tmp_path / "stories"
    shutil.copytree(stories_path, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "eos_token_id": [2, 7], "max_new_tokens": 9, **DEFAULTS})
    )
    return folder


def admit(engine, sampling: pb.SamplingParams, **inputs) -> SamplingParams:
    req = request_from_pb(pb.GenerateRequest(request_id="r", sampling=sampling, **inputs))
    return engine.admission.admit(req, {}).params


def test_a_request_that_sets_nothing_gets_the_model_defaults(model):
    engine = make_engine(model)
    params = admit(engine, pb.SamplingParams(), text="Once upon a time")
    assert {name: getattr(params, name) for name in DEFAULTS} == DEFAULTS
    assert params.max_tokens == 9 and params.unset == frozenset()
    assert engine.eos_token_ids == (2, 7)


def test_what_a_request_sets_wins_even_when_it_equals_the_engine_default(model):
    engine = make_engine(model)
    sampling = pb.SamplingParams(temperature=1.0, top_k=0, max_tokens=3)
    params = admit(engine, sampling, text="Once upon a time")
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, 3)
    assert (params.top_p, params.min_p, params.repetition_penalty) == (0.8, 0.05, 1.3)


def test_max_new_tokens_is_capped_to_the_context_left(model):
    engine = make_engine(model, max_model_len=12)
    params = admit(engine, pb.SamplingParams(), token_ids=pb.TokenIds(ids=[1, 5, 6, 7, 8, 9]))
    assert params.max_tokens == 6


@pytest.mark.parametrize(("mode", "eos"), [("vllm", (2, 7)), ("none", (2,))])
def test_vllm_and_none_keep_the_engine_defaults(model, mode, eos):
    engine = make_engine(model, generation_config=mode)
    params = admit(engine, pb.SamplingParams(), text="Once upon a time")
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        1.0,
        1.0,
        0,
        0.0,
        1.0,
    )
    assert params.max_tokens == 16  # OpenAI's completion default
    assert engine.eos_token_ids == eos


def test_eos_ids_of_generation_config_end_the_story(model, stories_path):
    engine = make_engine(stories_path)
    story = generate(engine, {"s": [1]}, greedy(62))["s"].token_ids
    comma = engine.tokenizer.encode(",", add_special_tokens=False)[-1]
    assert comma in story and comma not in engine.eos_token_ids
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, comma]}))
    out = generate(make_engine(model), {"s": [1]}, greedy(62))["s"]
    assert out.token_ids == story[: story.index(comma) + 1]
    assert (out.final.finish_reason, out.final.stop_token_id) == (FinishReason.STOP, comma)
    assert KNOWN_STORY.startswith(out.text.strip().rstrip(","))


def test_parameters_built_directly_count_as_set(model):
    engine = make_engine(model)
    req = GenerationRequest("r", SamplingParams(max_tokens=4), text="Once")
    params = engine.admission.admit(req, {}).params
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, 4)
    assert req.params.unset == frozenset()


def test_the_proto_mapping_marks_the_absent_fields_unset():
    params = sampling_from_pb(pb.SamplingParams(temperature=0.5, min_p=0.1))
    assert params.unset == frozenset(MODEL_DEFAULTABLE) - {"temperature", "min_p"}
    assert sampling_from_pb(pb.SamplingParams()).unset == frozenset(MODEL_DEFAULTABLE)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"top_p": 0.0}', r"generation_config.json: bad default top_p: must be in \(0, 1\], got 0.0"),
        ('{"temperature": -1}', "bad default temperature: must be >= 0"),
        ("{not json", "generation_config.json: invalid JSON"),
    ],
)
def test_a_bad_generation_config_fails_at_start_naming_the_field(model, content, message):
    (model / "generation_config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=message):
        make_engine(model)
    if "JSON" not in message:
        make_engine(model, generation_config="vllm")  # which ignores the sampling defaults
