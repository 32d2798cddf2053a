"""Speculative decoding with n-gram proposals (core/spec_decode.py): invisible in what a client gets.

Greedy: the same tokens, text, finish reason, usage and logprobs (within 1e-4) as without speculation,
whatever the request asks for; seeded sampling: the same tokens too (each verified position draws the
uniform of its position); unseeded sampling: the same distribution (a two-sample chi-square test). Every
test checks that proposals really were verified and accepted, and that every KV block came back
(`run_to_completion`). Speculation is forced on (no back-off) unless the test is about the back-off.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import pytest

from conduit_engine.engine.request import GenerationRequest
from conduit_engine.entrypoints.cli import build_parser, config_from_args
from conduit_engine.errors import ModelLoadError
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.speculation.config import SpeculativeConfig, parse_speculative_config
from conduit_engine.speculation.gate import SpecGate
from conduit_engine.speculation.ngram import NgramIndex
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.harness import Collected, greedy, make_engine, run_to_completion

pytestmark = pytest.mark.unit

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4, min_acceptance_rate=0.0)

# stories260K's greedy text from BOS (DATA.md), its first 62 tokens: prompts that hold it and then start
# it again are continued by repeating it, so n-gram proposals from the prompt are mostly accepted.
_STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def story(stories_path) -> list[int]:
    engine = make_engine(stories_path)
    return engine.tokenizer.hf.encode(_STORY, add_special_tokens=False).ids


def grounded(story: list[int], cut: int = 6) -> list[int]:
    return [1, *story, 1, *story[:cut]]


def run(model, requests: dict[str, tuple[list[int], SamplingParams]], **engine_kw):
    engine = make_engine(model, **engine_kw)
    for rid, (ids, params) in requests.items():
        engine.add_request(GenerationRequest(rid, params, token_ids=ids))
    seqs = engine.scheduler.waiting
    results = run_to_completion(engine)  # asserts integrity and that every block came back
    engine.test_preemptions = sum(seq.num_preemptions for seq in seqs)  # type: ignore[attr-defined]
    return engine, results


def client_view(c: Collected) -> tuple:
    final = c.final
    return (
        c.token_ids,
        c.text,
        final.finish_reason,
        final.stop_string,
        final.stop_token_id,
    )


def request_usage(results: dict[tuple[str, int], Collected]) -> dict[str, tuple[int, int, int]]:
    """Each request's usage when its last choice ended (a choice's own final output carries the running
    usage of the request, which depends on how far its siblings had got)."""
    usage: dict[str, tuple[int, int, int]] = {}
    for (rid, _), c in results.items():
        u = c.final.usage
        usage[rid] = max(usage.get(rid, (0, 0, 0)), (u.completion_tokens, u.prompt_tokens, u.cached_tokens))
    return usage


def assert_same_as_without(model, requests, spec: SpeculativeConfig = NGRAM, **engine_kw):
    """Run `requests` without and with speculation: the client sees the same; returns both runs."""
    _, plain = run(model, requests, **engine_kw)
    engine, speculated = run(model, requests, speculative=spec, **engine_kw)
    counters = engine.scheduler.spec.counters
    assert counters.num_accepted_tokens > 0, "no proposal token was accepted: the test proved nothing"
    assert {k: client_view(c) for k, c in speculated.items()} == {k: client_view(c) for k, c in plain.items()}
    assert request_usage(speculated) == request_usage(plain)
    for key, c in speculated.items():
        got = [lp for out in c.outputs for lp in out.logprobs]
        want = [lp for out in plain[key].outputs for lp in out.logprobs]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert (a.token_id, a.rank, a.top_ids) == (b.token_id, b.rank, b.top_ids)
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert all(
                math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True)
            )
    return engine, plain, speculated


# ----- configuration --------------------------------------------------------------------------------
def test_the_config_takes_vllms_json_shape():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    )
    assert config == SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{nope", "--speculative-config: not valid JSON"),
        ("[1]", "--speculative-config: must be a JSON object"),
        ('{"num_speculative_tokens": 4}', "--speculative-config: method is required"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "--speculative-config: method must be one of"),
        ('{"method": "ngram"}', "--speculative-config: num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer"),
        (
            '{"method": "ngram", "num_speculative_tokens": "4"}',
            'num_speculative_tokens must be an integer, got "4"',
        ),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}', "prompt_lookup_min"),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "prompt_lookup_max must be >= prompt_lookup_min (5), got 3",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "unknown field 'lookahead'"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', "model method draft_model needs"),
    ],
)
def test_a_bad_config_names_its_field(text, message):
    with pytest.raises(ValueError, match="^--speculative-config: ") as info:
        parse_speculative_config(text)
    assert message in str(info.value)


def test_the_cli_flag_reaches_the_engine_config():
    args = build_parser({}).parse_args(
        ["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert config_from_args(args).speculative == SpeculativeConfig("ngram", 3)
    assert config_from_args(build_parser({}).parse_args(["--model", "m"])).speculative is None
    bad = build_parser({}).parse_args(
        ["--model", "m", "--speculative-config", '{"method": 1, "num_speculative_tokens": 2}']
    )
    with pytest.raises(ValueError, match="method must be a string, got 1"):
        config_from_args(argparse.Namespace(**vars(bad)))


def test_ngram_lookup_takes_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7]
    assert index.propose(tokens, 3) == [8, 9, 6]  # "5 6 7" occurred at the start: the 3-gram wins
    assert index.propose([*tokens, 4], 3) == []  # 4 never occurred before
    other = [5, 6, 7, 8, 9, 6, 7, 1, 2, 4, 6, 7]
    assert NgramIndex(1, 3).propose(other, 3) == [1, 2, 4]  # no "4 6 7": the latest "6 7"
    assert NgramIndex(2, 2).propose([3, 3, 3], 5) == [3]  # capped at the sequence's end


# ----- greedy exactness -----------------------------------------------------------------------------
def test_greedy_tokens_text_and_logprobs_are_the_same(stories_path, story):
    requests = {
        "grounded": (grounded(story), greedy(60, ignore_eos=True, logprobs=3)),
        "free": ([1, 403, 407, 261, 378], greedy(48, ignore_eos=True, logprobs=2)),
        "short": (grounded(story, 10), greedy(5)),
        "eos": (grounded(story, 3), greedy(120)),  # may stop at EOS inside an accepted run
    }
    engine, plain, _ = assert_same_as_without(stories_path, requests)
    assert len(plain[("grounded", 0)].token_ids) == 60
    assert engine.scheduler.spec.counters.num_drafts > 5


def test_stop_strings_and_stop_tokens_inside_an_accepted_run(stories_path, story):
    # The grounded continuation repeats the story: "park" and the token of " girl" come inside runs.
    girl = story[story.index(story[10])]
    requests = {
        "string": (grounded(story), greedy(60, stop=["park"], ignore_eos=True)),
        "included": (grounded(story), greedy(60, stop=["play out"], include_stop_str_in_output=True)),
        "token": (grounded(story, 4), greedy(60, stop_token_ids=[girl], ignore_eos=True)),
    }
    _, plain, _ = assert_same_as_without(stories_path, requests)
    assert plain[("string", 0)].final.stop_string == "park"
    assert plain[("token", 0)].final.stop_token_id == girl


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 13])
def test_max_tokens_reached_in_the_middle_of_a_run(stories_path, story, max_tokens):
    requests = {"a": (grounded(story), greedy(max_tokens, ignore_eos=True))}
    requests["b"] = (grounded(story, 2), greedy(max_tokens + 9, ignore_eos=True))
    _, plain, _ = assert_same_as_without(stories_path, requests)
    assert len(plain[("a", 0)].token_ids) == max_tokens


def test_min_tokens_penalties_and_logit_bias(stories_path, story):
    eos = 2
    requests = {
        "min": (grounded(story), greedy(40, min_tokens=30, stop_token_ids=[story[12]], logprobs=1)),
        "rep": (grounded(story), greedy(40, repetition_penalty=1.3, ignore_eos=True, logprobs=1)),
        "freq": (grounded(story), greedy(40, frequency_penalty=0.4, presence_penalty=0.3, ignore_eos=True)),
        "bias": (grounded(story), greedy(40, logit_bias={story[8]: -100.0, eos: 5.0}, logprobs=2)),
    }
    assert_same_as_without(stories_path, requests)


def test_n_greater_than_one_and_a_shared_prefix(stories_path, story):
    prompt = grounded(story)
    requests = {
        "n": (prompt, greedy(30, n=3, ignore_eos=True)),
        "same-prefix": ([*prompt, *story[6:9]], greedy(30, ignore_eos=True)),
    }
    engine, plain, _ = assert_same_as_without(stories_path, requests)
    assert {i for rid, i in plain if rid == "n"} == {0, 1, 2}
    assert engine.block_manager.stats().prefix_hits > 0


def test_prefix_cache_serves_only_accepted_tokens(stories_path, story):
    """After speculated requests, a request whose prompt is one of their completions hits the prefix
    cache and still produces what a cold engine does: no rejected token's KV was ever cached."""
    engine = make_engine(stories_path, speculative=NGRAM, block_size=4)
    first = grounded(story)
    engine.add_request(GenerationRequest("a", greedy(90, ignore_eos=True), token_ids=first))
    done = run_to_completion(engine)[("a", 0)]
    assert (
        engine.scheduler.spec.counters.num_draft_tokens > engine.scheduler.spec.counters.num_accepted_tokens
    )
    follow = [*first, *done.token_ids]
    engine.add_request(GenerationRequest("b", greedy(20, ignore_eos=True, logprobs=1), token_ids=follow))
    warm = run_to_completion(engine)[("b", 0)]
    assert warm.outputs[0].usage.cached_tokens >= len(first)
    cold_engine = make_engine(stories_path, enable_prefix_caching=False, block_size=4)
    cold_engine.add_request(GenerationRequest("b", greedy(20, ignore_eos=True, logprobs=1), token_ids=follow))
    cold = run_to_completion(cold_engine)[("b", 0)]
    assert warm.token_ids == cold.token_ids
    for a, b in zip(warm.final.logprobs, cold.final.logprobs, strict=True):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


def test_preemption_with_few_blocks(stories_path, story):
    requests = {f"r{i}": (grounded(story, 3 + i), greedy(70, ignore_eos=True)) for i in range(6)}
    engine, _, _ = assert_same_as_without(stories_path, requests, num_blocks=40, block_size=4)
    assert engine.test_preemptions > 0, "nothing was preempted: the test proved nothing"


def test_grammar_constrained_requests_speculate_and_stay_exact(stories_path, story):
    """Each verified position is masked by the grammar's state after the proposed tokens before it."""
    regex = StructuredSpec(StructuredKind.REGEX, text=r"(Once|Then) upon a [a-z]+, [a-z ]+\. [A-Za-z .,]+")
    choice = StructuredSpec(
        StructuredKind.CHOICE, choices=("Once upon a time, there was a little girl", "no")
    )
    requests = {
        "regex": (grounded(story, 1), greedy(30, structured=regex, logprobs=1)),
        "choice": (grounded(story, 1), greedy(30, structured=choice)),
        "plain": (grounded(story), greedy(30, ignore_eos=True)),
    }
    assert_same_as_without(stories_path, requests)
    alone = {k: v for k, v in requests.items() if k != "plain"}
    engine, plain, _ = assert_same_as_without(stories_path, alone)
    assert engine.scheduler.spec.counters.num_drafts > 3
    assert plain[("choice", 0)].text == "Once upon a time, there was a little girl"


def test_chunked_prefill_and_a_small_token_budget(stories_path, story):
    # Proposals count in the step's budget: with 8 tokens a step, prefills and proposals share it.
    requests = {f"r{i}": (grounded(story, 2 + i), greedy(30, ignore_eos=True)) for i in range(3)}
    assert_same_as_without(stories_path, requests, max_num_batched_tokens=8)


# ----- sampling -------------------------------------------------------------------------------------
def test_seeded_sampling_gives_the_same_text_as_without_speculation_in_any_batch(stories_path, story):
    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True, n=2)

    alone = {"s": (grounded(story), sampled(7))}
    _, plain, speculated = assert_same_as_without(stories_path, alone)
    crowd = {f"x{i}": (grounded(story, 2 + i), sampled(100 + i)) for i in range(4)}
    crowd["s"] = alone["s"][0], sampled(7)
    _, in_batch = run(stories_path, crowd, speculative=NGRAM)
    assert in_batch[("s", 0)].token_ids == speculated[("s", 0)].token_ids == plain[("s", 0)].token_ids
    assert in_batch[("s", 1)].token_ids == plain[("s", 1)].token_ids


def test_unseeded_samples_are_distributed_as_without_speculation(stories_path, story):
    """Two-sample chi-square over the tokens emitted at output positions 1 to 4 (where proposals are
    verified) by 400 unseeded choices each at temperature 1.5 (proposals often rejected): no detectable
    difference. (Accepting 30% of the rejected proposal tokens anyway fails it.)"""
    prompt = grounded(story)
    params = SamplingParams(max_tokens=5, temperature=1.5, ignore_eos=True, n=100)
    counts = []
    for spec in (None, NGRAM):
        requests = {f"d{i}": (prompt, params) for i in range(4)}
        engine, results = run(stories_path, requests, speculative=spec)
        if spec is not None:
            c = engine.scheduler.spec.counters
            assert c.num_drafts >= 300 and 0 < c.num_accepted_tokens < c.num_draft_tokens
        counts.append(Counter((pos, c.token_ids[pos]) for c in results.values() for pos in range(1, 5)))
    statistic, dof = _chi_square(*counts)
    # The 0.001 critical value of chi-square with `dof` degrees (Wilson-Hilferty approximation).
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert statistic < critical, f"chi-square {statistic:.1f} over {dof} degrees of freedom"


def _chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories with at least 5 expected counts (the rare
    ones pooled into one), and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    cells: list[tuple[int, int]] = []
    rare = [0, 0]
    for key in keys:
        if (a[key] + b[key]) * min(na, nb) / (na + nb) < 5:
            rare[0] += a[key]
            rare[1] += b[key]
        else:
            cells.append((a[key], b[key]))
    if sum(rare):
        cells.append((rare[0], rare[1]))
    statistic = 0.0
    for x, y in cells:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        statistic += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return statistic, max(1, len(cells) - 1)


# ----- the back-off ---------------------------------------------------------------------------------
def test_a_sequence_whose_proposals_are_rejected_stops_speculating(stories_path):
    # Random sampling at a high temperature from a repetitive prompt: proposals, mostly rejected.
    prompt = [1, *([403, 407, 261, 378, 300] * 8)]
    params = SamplingParams(max_tokens=200, temperature=2.0, seed=3, ignore_eos=True)
    forced, _ = run(stories_path, {"a": (prompt, params)}, speculative=NGRAM)
    auto = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4, min_acceptance_rate=0.5)
    backed_off, results = run(stories_path, {"a": (prompt, params)}, speculative=auto)
    assert len(results[("a", 0)].token_ids) == 200
    assert forced.scheduler.spec.counters.acceptance_rate < 0.5
    assert backed_off.scheduler.spec.counters.num_drafts < forced.scheduler.spec.counters.num_drafts / 2


def test_the_gate_speculates_while_it_is_cheaper_per_token_and_explores_the_other_choice():
    gate = SpecGate(explore_every=4)
    assert gate.allow(16)  # nothing measured: measure speculation
    gate.observe(16, True, seconds=3.0, tokens=30)  # 0.1 s a token
    assert not gate.allow(16)  # then the other choice at once: the gate picks from both
    gate.observe(16, False, seconds=1.0, tokens=16)  # 0.0625 s a token: cheaper
    choices = [gate.allow(16) for _ in range(30)]
    # Not speculating is cheaper: tries after 4 steps, then 8, then 16 (as long as the choice holds).
    assert [i for i, c in enumerate(choices) if c] == [4, 12, 28]
    assert gate.costs(16) == (pytest.approx(0.1), pytest.approx(0.0625))
    assert gate.costs(15) == gate.costs(16) and gate.costs(1) == (None, None)  # buckets: powers of two
    assert not gate.allow(1)  # another size follows the nearest measured one at first


def test_a_dear_try_puts_the_next_one_off_until_trying_costs_at_most_two_percent():
    gate = SpecGate(explore_every=4)
    assert gate.allow(16)
    gate.observe(16, True, seconds=1.2, tokens=16)  # 0.075 s a token
    assert not gate.allow(16)
    gate.observe(16, False, seconds=1.0, tokens=16)  # 0.0625 s a token, 1 s a step: preferred
    assert [gate.allow(16) for _ in range(5)] == [False] * 4 + [True]
    # The try (a draft that sat idle catching up on every sequence) took 3 s for 32 tokens: 1 s more
    # than 32 tokens take without speculating, one preferred step lost: the next try is 50 steps on.
    gate.observe(16, True, seconds=3.0, tokens=32)
    choices = [gate.allow(16) for _ in range(60)]
    assert [i for i, c in enumerate(choices) if c] == [49]


def test_a_step_with_prefill_work_follows_the_preference_without_measuring_or_trying():
    gate = SpecGate(explore_every=4)
    assert gate.allow(16, measured=False)  # nothing measured: speculate, as a measured step would
    assert gate.allow(16)  # the first measured step still measures speculation
    gate.observe(16, True, seconds=2.0, tokens=16)
    assert gate.allow(16, measured=False)  # plain is unmeasured: unmeasured steps keep the default
    assert not gate.allow(16)
    gate.observe(16, False, seconds=1.0, tokens=16)
    assert not any(gate.allow(16, measured=False) for _ in range(100))  # no tries in unmeasured steps
    assert [gate.allow(16) for _ in range(5)] == [False] * 4 + [True]  # measured steps count to a try


# ----- draft model ----------------------------------------------------------------------------------
def truncated_copy(target, folder, layers: int, vocab_size: int | None = None):
    """`target` with only its first `layers` decoder layers (a draft of the same vocabulary), or with
    config.json claiming another vocabulary size."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, folder / item.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(target / "model.safetensors")
    kept = {
        k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def draft(model) -> SpeculativeConfig:
    return SpeculativeConfig("draft_model", 4, model=str(model), min_acceptance_rate=0.0)


def test_a_draft_model_is_exact_and_its_own_kv_follows_the_sequence(stories_path, story, tmp_path):
    """The target as its own draft accepts every proposed token (its KV cache mirrors the target's
    through catch-ups, prefix hits, n > 1 and preemptions); a two-layer cut of it accepts few. Both are
    exact."""
    requests = {
        "grounded": (grounded(story), greedy(50, ignore_eos=True, logprobs=2)),
        "free": ([1, 403, 407, 261, 378], greedy(40, ignore_eos=True)),
        "n": (grounded(story, 3), greedy(30, n=2, stop=["park"])),
        "pen": (grounded(story, 2), greedy(30, repetition_penalty=1.2, min_tokens=20)),
    }
    plain_greedy = {k: v for k, v in requests.items() if k != "pen"}  # the draft knows no penalties
    engine, _, _ = assert_same_as_without(stories_path, plain_greedy, spec=draft(stories_path))
    c = engine.scheduler.spec.counters
    assert c.num_accepted_tokens == c.num_draft_tokens > 100
    engine, _, _ = assert_same_as_without(
        stories_path, requests, spec=draft(stories_path), num_blocks=24, block_size=4
    )
    assert engine.test_preemptions > 0
    small = truncated_copy(stories_path, tmp_path / "two-layers", 2)
    engine, _, _ = assert_same_as_without(stories_path, requests, spec=draft(small))
    assert engine.scheduler.spec.counters.acceptance_rate < 0.5


def test_a_draft_of_another_vocabulary_is_refused_naming_the_field(stories_path, tmp_path):
    other = truncated_copy(stories_path, tmp_path / "other-vocab", 2, vocab_size=1024)
    with pytest.raises(ModelLoadError, match="^--speculative-config: model: the draft's vocabulary has 1024"):
        make_engine(stories_path, speculative=draft(other))
    with pytest.raises(ModelLoadError, match="^--speculative-config: model: .* lacks config.json"):
        make_engine(stories_path, speculative=draft(tmp_path))
    swapped = truncated_copy(stories_path, tmp_path / "swapped-tokens", 2)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match="^--speculative-config: model: the draft's tokenizer maps"):
        make_engine(stories_path, speculative=draft(swapped))


def test_decode_bursts_run_between_draft_proposals(stories_path, story, tmp_path):
    # A poor draft with the back-off on: sequences stop proposing, and their steps burst again.
    small = truncated_copy(stories_path, tmp_path / "two-layers", 2)
    spec = SpeculativeConfig("draft_model", 4, model=str(small))
    requests = {f"r{i}": (grounded(story, 2 + i), greedy(80, ignore_eos=True)) for i in range(3)}
    forced = {"max_decode_steps": 8, "decode_burst_ms": 1e6}
    _, plain = run(stories_path, requests)
    engine, speculated = run(stories_path, requests, speculative=spec, **forced)
    assert engine.scheduler.bursts.num_bursts > 0 and engine.scheduler.spec.counters.num_drafts > 0
    assert {k: c.token_ids for k, c in speculated.items()} == {k: c.token_ids for k, c in plain.items()}


@pytest.mark.parametrize(
    "placement", [{"worker_process": True}, {"tensor_parallel_size": 2}], ids=["worker", "tp2"]
)
def test_ngram_speculation_in_worker_processes_is_exact(stories_path, story, placement):
    requests = {
        "grounded": (grounded(story), greedy(40, ignore_eos=True, logprobs=1)),
        "seeded": (
            grounded(story, 3),
            SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True),
        ),
    }
    _, plain = run(stories_path, requests)
    engine, speculated = run(stories_path, requests, speculative=NGRAM, **placement)
    try:
        assert engine.scheduler.spec.counters.num_accepted_tokens > 0
        assert {k: c.token_ids for k, c in speculated.items()} == {k: c.token_ids for k, c in plain.items()}
    finally:
        engine.shutdown()


def test_a_new_batch_size_follows_the_nearest_measured_one_before_measuring_itself():
    gate = SpecGate(explore_every=4)
    assert gate.allow(16)
    gate.observe(16, True, seconds=3.0, tokens=10)
    gate.observe(16, False, seconds=1.0, tokens=16)  # at 16 sequences speculating is dearer
    assert [gate.allow(8) for _ in range(5)] == [False, False, False, False, True]  # then it measures
    fresh = SpecGate()
    assert fresh.allow(8)  # nothing measured anywhere: measure speculation first


def test_prompt_logprobs_are_the_same(stories_path, story):
    requests = {"p": (grounded(story), greedy(30, ignore_eos=True, prompt_logprobs=2, logprobs=1))}
    _, plain, speculated = assert_same_as_without(stories_path, requests)
    got, want = speculated[("p", 0)].outputs[0].prompt_logprobs, plain[("p", 0)].outputs[0].prompt_logprobs
    assert got is not None and want is not None and len(got) == len(want) == len(grounded(story)) - 1
    for a, b in zip(got, want, strict=True):
        assert a.top_ids == b.top_ids and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


def test_a_decode_engine_that_speculates_continues_a_disaggregated_request_exactly(stories_path, story):
    from tests.engine.support.pd_harness import assert_same, colocated_run, disaggregated

    prefill = make_engine(stories_path, role="prefill")
    decode = make_engine(stories_path, role="decode", speculative=NGRAM)
    colocated = make_engine(stories_path)
    prompt = grounded(story)
    for rid, params in {
        "g": greedy(40, ignore_eos=True, logprobs=1),
        "s": SamplingParams(max_tokens=30, temperature=1.0, seed=4, n=2, ignore_eos=True),
    }.items():
        assert_same(
            disaggregated(prefill, decode, rid, prompt, params), colocated_run(colocated, rid, prompt, params)
        )
    assert decode.scheduler.spec.counters.num_accepted_tokens > 0
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.block_manager.stats().used == 0
