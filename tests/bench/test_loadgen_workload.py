"""bench/loadgen/workload.py: length specs, seeded sampling, prompts of the asked token length."""

from __future__ import annotations

import random

import pytest

from bench.loadgen.runner import LoadPlan, poisson_arrivals
from bench.loadgen.workload import LengthDist, PromptBuilder

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("128", LengthDist("fixed", 128, lo=128, hi=128)),
        ("fixed:7", LengthDist("fixed", 7, lo=7, hi=7)),
        ("uniform:16,256", LengthDist("uniform", 16, 256, lo=16, hi=256)),
        ("normal:100,10", LengthDist("normal", 100, 10, lo=1, hi=140)),
        ("normal:100,10,90,110", LengthDist("normal", 100, 10, lo=90, hi=110)),
        ("lognormal:64,0.5", LengthDist("lognormal", 64, 0.5, lo=1, hi=512)),
    ],
)
def test_parse(spec, expected):
    assert LengthDist.parse(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gamma:3,4", "kind must be one of fixed, uniform, normal, lognormal"),
        ("uniform:5", "uniform takes 2 numbers"),
        ("normal:a,b", "arguments must be numbers"),
        ("uniform:10,5", "LO <= HI"),
        ("0", "lengths must be >= 1"),
    ],
)
def test_parse_errors_name_the_spec(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        LengthDist.parse(spec)
    assert repr(spec) in str(info.value)


@pytest.mark.parametrize("spec", ["uniform:16,256", "normal:100,30,50,150", "lognormal:64,0.7,8,300"])
def test_sampling_is_seeded_and_stays_in_bounds(spec):
    dist = LengthDist.parse(spec)
    first = dist.sample(2000, random.Random(7))
    assert first == dist.sample(2000, random.Random(7))
    assert first != dist.sample(2000, random.Random(8))
    assert min(first) >= dist.lo and max(first) <= dist.hi
    assert all(isinstance(x, int) for x in first)


def test_distribution_centres():
    # Fixed seed, so these are exact properties of one sequence, not statistical claims that may flake.
    normal = LengthDist.parse("normal:100,10,1,1000").sample(4000, random.Random(0))
    assert abs(sum(normal) / len(normal) - 100) < 1
    lognormal = sorted(LengthDist.parse("lognormal:64,0.5,1,10000").sample(4001, random.Random(0)))
    assert abs(lognormal[2000] - 64) <= 2  # the median
    assert LengthDist.parse("42").sample(3, random.Random(0)) == [42, 42, 42]


def test_poisson_arrivals_are_seeded_and_increasing():
    times = poisson_arrivals(2000, rate=4.0, seed=3)
    assert times == poisson_arrivals(2000, rate=4.0, seed=3)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:], strict=False))
    assert abs(times[-1] / (len(times) - 1) - 0.25) < 0.02  # mean gap 1/rate
    assert poisson_arrivals(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("mode", "value", "message"),
    [("concurrency", 0, "concurrency: must be an integer >= 1"), ("rate", -1.0, "request rate: must be > 0")],
)
def test_load_plan_errors(mode, value, message):
    with pytest.raises(ValueError, match=message):
        LoadPlan(mode, value)


@pytest.mark.parametrize("tokenizer", ["llama2_tokenizer_path", "stories_path"])
def test_prompts_have_the_exact_token_count_with_a_tokenizer(tokenizer, request):
    from tokenizers import Tokenizer

    folder = request.getfixturevalue(tokenizer)
    builder = PromptBuilder(folder)
    encode = Tokenizer.from_file(str(folder / "tokenizer.json")).encode
    prompt_len = LengthDist.parse("uniform:2,300")
    specs = builder.workload(60, prompt_len, LengthDist.parse("16"), seed=5)
    # the workload draws prompt lengths first from random.Random(seed)
    assert [s.prompt_tokens for s in specs] == prompt_len.sample(60, random.Random(5))
    assert [len(encode(s.prompt).ids) for s in specs] == [s.prompt_tokens for s in specs]
    assert len({s.prompt[:40] for s in specs}) == 60  # no shared prefixes between requests
    assert specs == builder.workload(60, prompt_len, LengthDist.parse("16"), seed=5)
    assert builder.build(1, random.Random(0))[1] == 2  # at least one token of text after BOS


def test_prompts_without_a_tokenizer_use_words():
    builder = PromptBuilder(corpus="one two three four five six seven eight nine ten eleven twelve")
    text, tokens = builder.build(8, random.Random(0))
    assert tokens is None
    assert len(text.split(" ")) == 6  # 0.75 word per token
