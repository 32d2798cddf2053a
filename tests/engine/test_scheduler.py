"""Scheduler: per-step records of who advanced, chunked prefill, priorities, preemption, admission.

Most tests drive the real Scheduler and BlockManager through `SimEngine` (no model: the next token
is a function of the prefix, and every step checks the KV slots a real model would read), so they
can assert exact per-step records. The last test runs the same story on a real tiny Llama with a
4,608-token context: a 4,000-token prompt prefilled in chunks while two streams keep decoding.
"""

from __future__ import annotations

import json
import random
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.request import GenerationRequest
from tests.engine.support.harness import greedy, make_engine
from tests.engine.support.model_factory import greedy_with, load_hf, make_tiny_model
from tests.engine.support.sched_sim import SimEngine, reference_output

pytestmark = pytest.mark.unit


def first_token_order(engine: SimEngine) -> list[str]:
    order: list[str] = []
    for record in engine.steps:
        order.extend(rid for rid in record.sampled if rid not in order)
    return order


def assert_streams_match_uninterrupted_runs(engine: SimEngine) -> None:
    for rid, seq in engine.seqs.items():
        assert engine.streams[rid] == reference_output(seq.prompt_token_ids, seq.params.max_tokens), rid


# ----- chunked prefill -----------------------------------------------------------------------------
def test_long_prompt_is_prefilled_over_several_steps_while_decodes_advance_every_step():
    engine = SimEngine(num_blocks=300, block_size=16, max_num_batched_tokens=512)
    engine.add("d1", [1] * 8, 40)
    engine.add("d2", [2] * 8, 40)
    first = engine.step()
    assert first.advanced == {"d1": 8, "d2": 8} and set(first.sampled) == {"d1", "d2"}
    engine.add("long", [3 + i % 90 for i in range(4000)], 3)
    records = [engine.step() for _ in range(8)]
    # 512-token budget: the two decodes take one token each, the long prompt the other 510.
    assert [r.advanced for r in records] == [{"d1": 1, "d2": 1, "long": 510}] * 7 + [
        {"d1": 1, "d2": 1, "long": 430}
    ]
    assert [sorted(r.sampled) for r in records] == [["d1", "d2"]] * 7 + [["d1", "d2", "long"]]
    assert all(not r.preempted for r in records)
    engine.run()
    assert_streams_match_uninterrupted_runs(engine)


def test_waiting_requests_are_admitted_behind_a_prefill_that_fills_the_budget():
    engine = SimEngine(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    engine.add("long", list(range(40)), 2)
    engine.add("short", [5, 6], 2)
    records = engine.run()
    assert [r.advanced for r in records] == [
        {"long": 16},
        {"long": 16},
        {"long": 8, "short": 2},  # the budget left after the last chunk admits the next request
        {"long": 1, "short": 1},
    ]


# ----- priorities ----------------------------------------------------------------------------------
def test_lower_priority_value_runs_first_and_ties_are_first_come_first_served():
    engine = SimEngine(num_blocks=64, block_size=4, max_num_seqs=1)
    engine.add("busy", [1, 2, 3], 2)
    engine.step()
    for rid, priority in [("p5-a", 5), ("p0-a", 0), ("p3", 3), ("p0-b", 0), ("p5-b", 5), ("n1", -1)]:
        engine.add(rid, [len(rid), priority + 10], 2, priority=priority)
    engine.run()
    assert first_token_order(engine) == ["busy", "n1", "p0-a", "p0-b", "p3", "p5-a", "p5-b"]
    assert_streams_match_uninterrupted_runs(engine)


def test_waiting_list_is_in_priority_then_arrival_order():
    engine = SimEngine(num_blocks=8, block_size=4)
    for rid, priority in [("a", 2), ("b", 1), ("c", 2), ("d", 1)]:
        engine.add(rid, [1], 1, priority=priority)
    assert [s.request_id for s in engine.scheduler.waiting] == ["b", "d", "a", "c"]


# ----- preemption ----------------------------------------------------------------------------------
def three_running(priorities: dict[str, int]) -> SimEngine:
    """Three requests of 3 prompt tokens on 6 blocks of 2: at the third step the cache is full."""
    engine = SimEngine(num_blocks=6, block_size=2, max_num_seqs=3)
    for rid, priority in priorities.items():
        engine.add(rid, [ord(rid), 1, 2], 6, priority=priority)
    assert engine.step().advanced == {"a": 3, "b": 3, "c": 3}
    assert engine.step().advanced == {"a": 1, "b": 1, "c": 1}
    return engine


def test_preemption_takes_the_lowest_priority_running_request():
    engine = three_running({"a": 0, "b": 2, "c": 1})
    record = engine.step()
    # `a` needs a third block; b has the largest priority value, though c was admitted later.
    assert record.preempted == ["b"]
    assert record.advanced == {"a": 1, "c": 1}
    assert engine.seqs["b"].block_table == [] and engine.seqs["b"].num_preemptions == 1
    engine.run()
    assert_streams_match_uninterrupted_runs(engine)


def test_preemption_among_equals_takes_the_latest_admitted_and_requeues_it_first():
    engine = three_running({"a": 0, "b": 0, "c": 0})
    engine.add("d", [9], 1)  # waits: max_num_seqs is 3
    record = engine.step()
    assert record.preempted == ["c"]
    assert record.advanced == {"a": 1, "b": 1}
    # Back at the front of its priority: it arrived before d.
    assert [s.request_id for s in engine.scheduler.waiting] == ["c", "d"]
    engine.run()
    assert first_token_order(engine)[-1] == "d"
    assert_streams_match_uninterrupted_runs(engine)


def test_a_preempted_request_resumes_with_no_duplicate_or_missing_tokens():
    engine = SimEngine(num_blocks=8, block_size=2)
    engine.add("a", [1, 2, 3], 9)
    engine.add("b", [4, 5, 6], 9, priority=1)
    records = engine.run()
    b = engine.seqs["b"]
    assert b.num_preemptions == 1
    preempted_at = next(i for i, r in enumerate(records) if r.preempted == ["b"])
    resumed_at = next(i for i, r in enumerate(records) if i > preempted_at and "b" in r.advanced)
    assert all("b" not in r.sampled for r in records[preempted_at:resumed_at])
    # b held 3 + 6 tokens; two of its four full blocks survived in the cache and are not recomputed.
    assert records[resumed_at].advanced["b"] == 5
    assert len(engine.streams["b"]) == 9
    assert_streams_match_uninterrupted_runs(engine)


# ----- admission -----------------------------------------------------------------------------------
def test_max_num_seqs_caps_the_batch():
    engine = SimEngine(num_blocks=64, block_size=4, max_num_seqs=2)
    for rid in "abc":
        engine.add(rid, [ord(rid)], 3)
    records = engine.run()
    assert [sorted(r.advanced) for r in records] == [["a", "b"], ["a", "b"], ["a", "b"], ["c"], ["c"], ["c"]]


def test_a_request_that_does_not_fit_waits_at_the_head_of_the_queue():
    engine = SimEngine(num_blocks=4, block_size=2)
    engine.add("big", [1] * 5, 2)  # 3 blocks
    engine.add("small", [2], 1)  # 1 block
    engine.add("next", [3] * 3, 2)  # 2 blocks: none free until big finishes
    engine.add("tiny", [4], 1)  # 1 block would be free at step 2, but first come, first served
    records = engine.run()
    assert [r.advanced for r in records] == [
        {"big": 5, "small": 1},
        {"big": 1},
        {"next": 3, "tiny": 1},
        {"next": 1},
    ]
    assert_streams_match_uninterrupted_runs(engine)


def test_siblings_wait_for_the_first_choice_then_reuse_its_prompt():
    engine = SimEngine(num_blocks=32, block_size=2)
    parent, *siblings = engine.add("r", list(range(1, 10)), 4, n=3)
    assert engine.step().advanced == {"r": 9}
    # The prompt's 4 full blocks are cached now; each sibling computes only the last prompt token.
    assert engine.step().advanced == {"r": 1, "r/1": 1, "r/2": 1}
    assert [s.num_cached_tokens for s in siblings] == [8, 8]
    assert parent.num_cached_tokens == 0
    assert all(s.block_table[:4] == parent.block_table[:4] for s in siblings)
    engine.run()


def test_abort_frees_the_blocks_of_running_and_waiting_requests():
    engine = SimEngine(num_blocks=4, block_size=2, max_num_seqs=1)
    engine.add("running", [1, 2, 3], 5)
    engine.add("waiting", [4, 5], 5)
    engine.step()
    assert engine.block_manager.stats().used == 2
    engine.abort("waiting")
    engine.abort("running")
    assert not engine.scheduler.has_work()
    assert engine.block_manager.stats().used == 0
    engine.block_manager.check_integrity([])


# ----- bugs fixed ----------------------------------------------------------------------------------
def test_without_chunked_prefill_a_prompt_longer_than_the_budget_still_runs():
    # Bug fixed: it could never be scheduled whole, so it waited forever.
    engine = SimEngine(num_blocks=16, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    engine.add("long", list(range(20)), 2)
    records = engine.run(max_steps=50)
    assert [r.advanced for r in records] == [{"long": 8}, {"long": 8}, {"long": 4}, {"long": 1}]
    assert_streams_match_uninterrupted_runs(engine)


def test_without_chunked_prefill_a_prompt_that_fits_is_not_split():
    engine = SimEngine(num_blocks=16, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    engine.add("a", [1, 2, 3, 4, 5], 3)
    engine.add("b", [6, 7, 8, 9, 10], 1)  # 5 tokens; only 3 left this step: waits for the next
    records = engine.run(max_steps=50)
    assert [r.advanced for r in records] == [{"a": 5}, {"a": 1, "b": 5}, {"a": 1}]


def test_without_chunked_prefill_a_recompute_longer_than_the_budget_resumes():
    # Bug fixed: b was preempted holding 13 tokens; its recompute never fit an 8-token step.
    engine = SimEngine(
        num_blocks=12,
        block_size=2,
        max_num_batched_tokens=8,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    engine.add("a", [1, 2], 14)
    engine.add("b", [3, 4], 12)
    records = engine.run(max_steps=100)
    assert [r.preempted for r in records if r.preempted] == [["b"], ["b"]]
    assert engine.seqs["b"].num_preemptions == 2
    assert [r.advanced.get("b") for r in records[11:16]] == [None, 7, None, 8, 5]
    assert_streams_match_uninterrupted_runs(engine)


def test_the_hit_rate_counts_each_prompt_once_however_long_it_waits():
    # Bug fixed: every failed admission attempt of a waiting request counted its prompt again.
    engine = SimEngine(num_blocks=6, block_size=2)
    engine.add("warm", [1, 2, 3, 4, 5], 1)
    engine.run()
    engine.add("hog", [7] * 7, 2)  # takes 4 of the 6 blocks for two steps
    engine.add("hit", [1, 2, 3, 4, 9, 9, 9], 1)  # hits 2 cached blocks but needs 2 more
    records = engine.run()
    assert [sorted(r.advanced) for r in records] == [["hog"], ["hog"], ["hit"]]
    assert engine.seqs["hit"].num_cached_tokens == 4
    stats = engine.block_manager.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (5 + 7 + 7, 4)


def test_the_hit_rate_does_not_count_a_recompute_after_preemption():
    engine = SimEngine(num_blocks=8, block_size=2)
    engine.add("a", [1, 2, 3], 9)
    engine.add("b", [4, 5, 6], 9, priority=1)
    engine.run()
    assert engine.seqs["b"].num_preemptions == 1
    stats = engine.block_manager.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (6, 0)


# ----- random workloads ----------------------------------------------------------------------------
STEM = [(7 * i + 3) % 97 for i in range(12)]  # prompts share prefixes of this stem


class Arrival(NamedTuple):
    step: int
    stem_tokens: int
    tail: list[int]
    max_tokens: int
    priority: int
    n: int
    abort_at: int | None

    @property
    def prompt(self) -> list[int]:
        return STEM[: self.stem_tokens] + self.tail


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 5),
    stem_tokens=st.integers(0, 12),
    tail=st.lists(st.integers(0, 96), min_size=1, max_size=4),
    max_tokens=st.integers(1, 7),
    priority=st.integers(0, 2),
    n=st.integers(1, 2),
    abort_at=st.none() | st.integers(0, 19),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(4, 24),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    prefix_caching=st.booleans(),
    chunked_prefill=st.booleans(),
    sliding_window=st.none() | st.integers(1, 12),
    requests=st.lists(arrivals, min_size=1, max_size=7),
)
def test_random_workloads_finish_with_uninterrupted_outputs(
    block_size, num_blocks, max_num_seqs, budget, prefix_caching, chunked_prefill, sliding_window, requests
):
    engine = SimEngine(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked_prefill,
        sliding_window=sliding_window,
    )
    # The engine refuses what can never fit the cache (INVALID_ARGUMENT); so does this workload.
    bm = engine.block_manager
    requests = [
        r for r in requests if bm.blocks_for_sequence(len(r.prompt) + r.max_tokens, budget) <= num_blocks
    ]
    for step in range(2000):
        for i, r in enumerate(requests):
            if r.step == step:
                engine.add(f"r{i}", r.prompt, r.max_tokens, priority=r.priority, n=r.n)
            if r.abort_at == step:
                for name in [k for k in engine.seqs if k.split("/")[0] == f"r{i}"]:
                    engine.abort(name)
        if engine.scheduler.has_work():
            engine.step()
        elif step > 5:
            break
    assert not engine.scheduler.has_work(), "livelock: requests left unfinished"
    assert engine.block_manager.stats().used == 0
    assert len(engine.seqs) == sum(r.n for r in requests)
    for name, seq in engine.seqs.items():
        expected = reference_output(seq.prompt_token_ids, seq.params.max_tokens)
        got = engine.streams[name]
        assert got == (expected[: len(got)] if seq.finish_reason is FinishReason.ABORT else expected), name


# ----- sliding window --------------------------------------------------------------------------------
def test_a_windowed_sequence_longer_than_the_cache_runs_in_a_bounded_number_of_blocks():
    # 70 tokens need 18 blocks of 4; the cache has 6. With an 8-token window and 8-token chunks a
    # sequence holds at most blocks_for_sequence = ceil((7 + 8) / 4) + 1 = 5 of them (the simulator
    # checks it every step); chunks starting on block edges, as here, need 4.
    engine = SimEngine(num_blocks=6, block_size=4, max_num_batched_tokens=8, sliding_window=8)
    assert engine.block_manager.blocks_for_sequence(70, 8) == 5
    engine.add("long", list(range(30)), 40)
    engine.run()
    assert_streams_match_uninterrupted_runs(engine)
    assert engine.max_blocks_held == 4
    assert not any(record.preempted for record in engine.steps)


def test_windowed_prefix_hits_reuse_released_blocks_and_release_them_again():
    engine = SimEngine(num_blocks=16, block_size=4, max_num_batched_tokens=64, sliding_window=6)
    prompt = list(range(40, 70))
    engine.add("first", prompt, 3)
    engine.run()
    (second,) = engine.add("second", prompt + [1, 2], 3)
    engine.step()
    # 28 tokens came from the cache, 4 were computed; the next query (position 32) sees 27.. so blocks
    # 0-5 (tokens 0-23) went back.
    assert second.num_cached_tokens == 28
    assert second.num_computed_tokens == 32 and second.num_released_blocks == 6
    engine.run()
    assert_streams_match_uninterrupted_runs(engine)


def test_windowed_siblings_and_preemption_keep_every_read_in_the_window():
    engine = SimEngine(num_blocks=9, block_size=2, max_num_batched_tokens=6, sliding_window=5)
    engine.add("a", list(range(1, 12)), 20, n=2)
    engine.add("b", list(range(30, 44)), 18, priority=1)
    engine.add("c", list(range(1, 9)), 16)
    engine.run()
    assert_streams_match_uninterrupted_runs(engine)
    assert any(record.preempted for record in engine.steps)


# ----- the same story on a real model --------------------------------------------------------------
def test_real_model_long_prompt_chunks_while_two_streams_keep_decoding(tmp_path):
    folder = make_tiny_model(tmp_path / "ctx4608", seed=3)
    # make_tiny_model fixes max_position_embeddings at 512 (passing it again collides), so widen the
    # context in the saved config: RoPE has no learned positions, the weights are unchanged.
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 4608
    config_path.write_text(json.dumps(config))
    engine = make_engine(folder, num_blocks=300, block_size=16, max_num_batched_tokens=512)
    assert engine.max_model_len == 4608
    rng = random.Random(11)
    prompts = {
        "d1": [1] + [rng.randrange(3, 259) for _ in range(7)],
        "d2": [1] + [rng.randrange(3, 259) for _ in range(7)],
        "long": [1] + [rng.randrange(3, 259) for _ in range(3999)],
    }
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}

    def step() -> list[str]:
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.token_ids)
        return sorted(out.request_id for out in outputs)

    for rid in ("d1", "d2"):
        engine.add_request(GenerationRequest(rid, greedy(24, ignore_eos=True), token_ids=prompts[rid]))
    assert step() == ["d1", "d2"]
    engine.add_request(GenerationRequest("long", greedy(4, ignore_eos=True), token_ids=prompts["long"]))
    (long_seq,) = engine.scheduler.waiting
    computed, got_tokens = [], []
    while not tokens["long"]:
        got_tokens.append(step())
        computed.append(long_seq.num_computed_tokens)
    # Eight steps of prefill (7 x 510 + 430 tokens); both streams got a token in every one of them.
    assert computed == [510 * i for i in range(1, 8)] + [4000]
    assert got_tokens == [["d1", "d2"]] * 7 + [["d1", "d2", "long"]]
    while engine.has_work():
        step()
    engine.check_integrity()
    model = load_hf(folder)
    assert tokens["d1"] == greedy_with(model, prompts["d1"], 24)
    assert tokens["d2"] == greedy_with(model, prompts["d2"], 24)
    assert tokens["long"] == greedy_with(model, prompts["long"], 4)
