"""Greedy parity with transformers under prefix caching, chunked prefill and forced preemption.

Runs on ../shared/models/stories260K and on a tiny random Llama. Each test also proves the
mechanism it is about really ran (cached tokens reported, prompts longer than the step budget,
preemptions counted), so parity is never shown by a run that avoided the hard path.
"""

from __future__ import annotations

import random

import pytest

from conduit_engine.engine.request import GenerationRequest
from tests.engine.support.harness import Collected, generate, greedy, make_engine, run_to_completion
from tests.engine.support.model_factory import greedy_with, load_hf, make_tiny_model
from tests.engine.test_block_manager import COLLIDING_BLOCKS

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", family="llama", seed=5)


@pytest.fixture(params=["stories260K", "tiny-llama"])
def model(request):
    if request.param == "stories260K":
        return request.getfixturevalue("stories_path"), 512
    return request.getfixturevalue("tiny_llama"), 259


def random_tokens(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def submit(engine, prompts: dict[str, list[int]], max_tokens: int) -> list:
    """Queue the prompts; returns their sequences (kept to read counters after they finish)."""
    for rid, ids in prompts.items():
        engine.add_request(GenerationRequest(rid, greedy(max_tokens, ignore_eos=True), token_ids=ids))
    return list(engine.scheduler.waiting)


def assert_streamed_in_order(collected: Collected, expected: list[int]) -> None:
    """The client's view: every output adds the next tokens (one, or several after a decode burst);
    none repeated, none missing, and only the last output is final."""
    assert all(o.token_ids for o in collected.outputs)
    assert collected.token_ids == expected
    assert [o.finished for o in collected.outputs] == [False] * (len(collected.outputs) - 1) + [True]


def test_prefix_cache_hits_match_transformers(model):
    folder, vocab = model
    hf = load_hf(folder)
    engine = make_engine(folder, block_size=4, num_blocks=128)
    rng = random.Random(1)
    system = [1] + random_tokens(rng, vocab, 22)
    first_prompt = system + random_tokens(rng, vocab, 3)
    first = generate(engine, {"first": first_prompt}, greedy(12, ignore_eos=True))["first"]
    prompts = {
        "same-system": system + random_tokens(rng, vocab, 5),
        "half-system": system[:10] + random_tokens(rng, vocab, 6),
        "system-only": list(system),
        # The first request's prompt and output: the blocks it filled while decoding are cached too.
        "continuation": first_prompt + first.token_ids + random_tokens(rng, vocab, 2),
    }
    results = generate(engine, prompts, greedy(16, ignore_eos=True))
    for rid, ids in prompts.items():
        assert results[rid].token_ids == greedy_with(hf, ids, 16), rid
    cached = {rid: results[rid].final.usage.cached_tokens for rid in prompts}
    # Whole cached 4-token blocks, and always at least the last prompt token left to compute.
    assert cached == {"same-system": 20, "half-system": 8, "system-only": 20, "continuation": 36}
    assert first.final.usage.cached_tokens == 0


def test_chunked_prefill_matches_transformers(model):
    folder, vocab = model
    hf = load_hf(folder)
    budget = 7
    engine = make_engine(folder, block_size=4, num_blocks=128, max_num_batched_tokens=budget)
    rng = random.Random(2)
    prompts = {f"p{i}": [1] + random_tokens(rng, vocab, n) for i, n in enumerate((9, 17, 30, 41))}
    seqs = submit(engine, prompts, 10)
    prefill_steps = dict.fromkeys(prompts, 0)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work():
        before = {s.request_id: s.num_computed_tokens for s in seqs}
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        for s in seqs:
            if s.num_computed_tokens != before[s.request_id] and before[s.request_id] < s.num_prompt_tokens:
                prefill_steps[s.request_id] += 1
    engine.check_integrity()
    # Every prompt is longer than the step budget, so each was prefilled over several steps.
    for rid, ids in prompts.items():
        assert prefill_steps[rid] >= -(-len(ids) // budget) >= 2, rid
        assert tokens[rid] == greedy_with(hf, ids, 10), rid


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-on", "prefix-off"])
def test_forced_preemption_matches_transformers(model, prefix_caching):
    folder, vocab = model
    hf = load_hf(folder)
    # 12 blocks of 4 tokens: each request needs up to 10 blocks, four of them cannot run together.
    engine = make_engine(
        folder, block_size=4, num_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching
    )
    rng = random.Random(3)
    shared = [1] + random_tokens(rng, vocab, 8)
    prompts = {f"r{i}": shared + random_tokens(rng, vocab, 3 + 2 * i) for i in range(4)}
    seqs = submit(engine, prompts, 24)
    results = run_to_completion(engine)
    assert sum(s.num_preemptions for s in seqs) >= 2
    for rid, ids in prompts.items():
        assert_streamed_in_order(results[(rid, 0)], greedy_with(hf, ids, 24))


def test_three_block_prefix_is_reported_as_cached(stories_path):
    engine = make_engine(stories_path, block_size=16, num_blocks=64)
    rng = random.Random(4)
    prefix = [1] + random_tokens(rng, 512, 47)  # exactly three blocks of 16
    a = generate(engine, {"a": prefix + random_tokens(rng, 512, 5)}, greedy(4, ignore_eos=True))["a"]
    b_prompt = prefix + random_tokens(rng, 512, 7)
    b = generate(engine, {"b": b_prompt}, greedy(4, ignore_eos=True))["b"]
    assert ({o.usage.cached_tokens for o in a.outputs}, len(a.token_ids)) == ({0}, 4)
    assert ({o.usage.cached_tokens for o in b.outputs}, len(b.token_ids)) == ({48}, 4)
    assert b.final.usage.prompt_tokens == 55
    assert b.token_ids == greedy_with(load_hf(stories_path), b_prompt, 4)
    stats = engine.block_manager.stats()
    assert (stats.cached, stats.prefix_queries, stats.prefix_hits) == (3, 53 + 55, 48)


def test_prefix_caching_off_reports_no_cached_tokens(stories_path):
    engine = make_engine(stories_path, block_size=16, num_blocks=64, enable_prefix_caching=False)
    prefix = [1] + random_tokens(random.Random(4), 512, 47)
    for rid in ("a", "b"):
        out = generate(engine, {rid: prefix + [7, 8, 9]}, greedy(4, ignore_eos=True))[rid]
        assert ({o.usage.cached_tokens for o in out.outputs}, len(out.token_ids)) == ({0}, 4)
    stats = engine.block_manager.stats()
    assert (stats.cached, stats.prefix_hits, stats.hit_rate) == (0, 0, 0.0)


def test_prompt_logprobs_are_complete_when_the_prompt_is_cached(stories_path):
    # Bug fixed: the second request's cached positions were never run, so it got 0 of 20 logprobs.
    engine = make_engine(stories_path, block_size=4)
    prompt = [1] + list(range(10, 30))
    params = greedy(3, prompt_logprobs=1)
    first = generate(engine, {"a": prompt}, params)["a"].outputs[0].prompt_logprobs
    second_out = generate(engine, {"b": prompt}, params)["b"]
    second = second_out.outputs[0].prompt_logprobs
    assert len(first) == len(second) == 20
    assert [lp.token_id for lp in second] == prompt[1:]
    assert [lp.logprob for lp in second] == pytest.approx([lp.logprob for lp in first], abs=1e-5)
    assert second_out.final.usage.cached_tokens == 0


def test_prompts_whose_python_hashes_collide_get_their_own_kv(stories_path):
    # Bug fixed: with Python's 64-bit hash as the chain hash, the second prompt's second block
    # "hit" the first prompt's (a crafted collision) and generation ran on the wrong KV.
    engine = make_engine(stories_path, block_size=16)
    hf = load_hf(stories_path)
    shared = [1] + [7] * 15  # a genuinely shared first block, so the colliding blocks have a parent
    for rid, block, cached in zip(("first", "second"), COLLIDING_BLOCKS, (0, 16), strict=True):
        prompt = [*shared, *block, 5]
        out = generate(engine, {rid: prompt}, greedy(8, ignore_eos=True))[rid]
        assert out.final.usage.cached_tokens == cached, rid
        assert out.token_ids == greedy_with(hf, prompt, 8), rid


def test_engine_priorities_lower_first_ties_in_arrival_order(stories_path):
    engine = make_engine(stories_path, max_num_seqs=1)
    engine.add_request(GenerationRequest("busy", greedy(3, ignore_eos=True), token_ids=[1, 5]))
    engine.step()
    for rid, priority in [("late", 4), ("urgent-1", -2), ("normal", 0), ("urgent-2", -2)]:
        engine.add_request(
            GenerationRequest(rid, greedy(2, ignore_eos=True), token_ids=[1, 9], priority=priority)
        )
    order: list[str] = []
    while engine.has_work():
        order.extend(o.request_id for o in engine.step() if o.request_id not in order)
    assert order == ["busy", "urgent-1", "urgent-2", "normal", "late"]
