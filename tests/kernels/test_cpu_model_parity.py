"""The whole model on each instruction set of kernels/cpu (forced in turn): greedy tokens equal
transformers' and logprobs agree within 1e-4 for every architecture in float32, and bfloat16 stays
within its rounding of float32. tests/engine runs the same checks on the torch ops and the default."""

from __future__ import annotations

import pytest

from conduit_engine.ops import cpu_kernels
from tests.engine.support.bf16_closeness import check_bf16_logprobs_close_to_f32
from tests.engine.support.harness import generate, greedy, make_engine
from tests.engine.support.model_factory import hf_greedy, make_tiny_model
from tests.engine.test_architectures import ARCHS, check_greedy_and_logprobs
from tests.support.shared import skip_or_fail
from tests.support.stories import KNOWN_STORY, KNOWN_STORY_TOKENS

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module", params=cpu_kernels.ISAS)
def isa(request) -> str:
    try:
        supported = cpu_kernels.supported_isas()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        skip_or_fail(f"the CPU kernels cannot be built here: {exc}")
    if request.param not in supported:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    return request.param


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return {
        name: make_tiny_model(tmp_path_factory.mktemp(name) / "model", **kw) for name, kw in ARCHS.items()
    }


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_architectures_match_transformers(isa, tiny_models, name):
    check_greedy_and_logprobs(name, tiny_models[name], isa)


def test_stories260k_known_story(isa, stories_path):
    engine = make_engine(stories_path, cpu_kernels=isa)
    out = generate(engine, {"bos": [1]}, greedy(KNOWN_STORY_TOKENS))["bos"]
    assert out.token_ids == hf_greedy(stories_path, [1], KNOWN_STORY_TOKENS)
    assert engine.tokenizer.decode(out.token_ids).strip() == KNOWN_STORY


def test_bfloat16_logprobs_stay_close_to_float32(isa, stories_path):
    check_bf16_logprobs_close_to_f32(stories_path, isa)
