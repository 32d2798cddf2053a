"""Speculative decoding's draft model with the target in worker processes (--tensor-parallel-size 2 on
the CPU's gloo, and --worker-process): the draft runs whole in the engine process with its own KV cache
(the target's block ids), the workers verify its proposals in the STEP frame.

Against the same placement without speculation: greedy tokens, text, finish reasons and logprobs (within
1e-4) are the same; seeded sampling gives the same tokens as without speculation, alone or in a batch;
every KV block comes back (`run_to_completion`: the draft's KV lives in the same blocks, so zero used
blocks is zero for both caches); the acceptance reaches GetLoad and the Prometheus counters of a real
server. The target as its own draft accepts every proposal (the draft's cache follows the sequence
exactly, through prefix hits, n > 1 and preemptions); a four-layer cut of it (of five) accepts some.
"""

from __future__ import annotations

import math
import multiprocessing

import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    TelemetryConfig,
)
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import ModelLoadError
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.speculation.config import SpeculativeConfig
from tests.engine.support.harness import greedy, make_engine, run_to_completion
from tests.engine.support.server_thread import ServerThread
from tests.engine.test_speculative import _STORY, client_view, draft, grounded, truncated_copy
from tests.support.prometheus import scrape

pytestmark = pytest.mark.integration

TP2 = {"tensor_parallel_size": 2}
SMALL_CACHE = {"num_blocks": 24, "block_size": 4}  # preempts the batch below


@pytest.fixture(scope="module")
def story(stories_path) -> list[int]:
    engine = make_engine(stories_path)
    return engine.tokenizer.hf.encode(_STORY, add_special_tokens=False).ids


def seeded(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=seed, n=n, ignore_eos=True)


def workload(story: list[int]) -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        "grounded": (grounded(story), greedy(40, ignore_eos=True, logprobs=2)),
        "free": ([1, 403, 407, 261, 378], greedy(30, ignore_eos=True, logprobs=1)),
        "n": (grounded(story, 3), greedy(30, n=2, stop=["park"])),
        "seeded": (grounded(story, 4), seeded(5, n=2)),
    }


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (ids, params) in requests.items():
        engine.add_request(GenerationRequest(rid, params, token_ids=ids))
    seqs = list(engine.scheduler.waiting)
    results = run_to_completion(engine)  # asserts integrity and that every block came back
    assert engine.block_manager.stats().used == 0
    return results, sum(seq.num_preemptions for seq in seqs)


def assert_same(speculated, plain) -> None:
    assert {k: client_view(c) for k, c in speculated.items()} == {k: client_view(c) for k, c in plain.items()}
    for key, c in speculated.items():
        got = [lp for out in c.outputs for lp in out.logprobs]
        want = [lp for out in plain[key].outputs for lp in out.logprobs]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert (a.token_id, a.top_ids) == (b.token_id, b.top_ids)
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


@pytest.fixture(scope="module")
def tp2_plain(stories_path):
    """TP=2 without speculation, with the default cache and with the small one."""
    engines = {"default": make_engine(stories_path, **TP2)}
    try:
        engines["small"] = make_engine(stories_path, **TP2, **SMALL_CACHE)
        yield engines
    finally:
        for engine in engines.values():
            engine.shutdown()


def test_tp2_with_the_target_as_its_own_draft_accepts_everything_and_is_exact(stories_path, story, tp2_plain):
    requests = workload(story)
    greedy_only = {k: v for k, v in requests.items() if k != "seeded"}
    engine = make_engine(stories_path, speculative=draft(stories_path), **TP2)
    try:
        assert engine.executor.draft is not None
        speculated, _ = run(engine, greedy_only)
        c = engine.scheduler.spec.counters
        assert c.num_accepted_tokens == c.num_draft_tokens >= 80
        plain, _ = run(tp2_plain["default"], greedy_only)
        assert_same(speculated, plain)
        again, _ = run(engine, greedy_only)  # prefix hits: the draft's KV of the cached blocks is there
        assert {k: x.token_ids for k, x in again.items()} == {k: x.token_ids for k, x in plain.items()}
        assert c.num_accepted_tokens == c.num_draft_tokens
    finally:
        engine.shutdown()


def test_tp2_with_a_smaller_draft_is_exact_through_preemptions_and_seeded_sampling(
    stories_path, story, tp2_plain, tmp_path
):
    small = truncated_copy(stories_path, tmp_path / "four-layers", 4)
    requests = workload(story)
    engine = make_engine(stories_path, speculative=draft(small), **TP2, **SMALL_CACHE)
    try:
        speculated, preemptions = run(engine, requests)
        c = engine.scheduler.spec.counters
        assert preemptions > 0
        assert 0 < c.num_accepted_tokens < c.num_draft_tokens
        plain, _ = run(tp2_plain["small"], requests)
        assert_same(speculated, plain)
        # The same seed gives the same text alone as in the batch (and as without speculation).
        alone, _ = run(engine, {"seeded": requests["seeded"]})
        assert {k: x.token_ids for k, x in alone.items()} == {
            k: x.token_ids for k, x in plain.items() if k[0] == "seeded"
        }
    finally:
        engine.shutdown()


def test_one_worker_process_with_a_draft_is_exact(stories_path, story, tmp_path):
    small = truncated_copy(stories_path, tmp_path / "four-layers", 4)
    requests = workload(story)
    plain, _ = run(make_engine(stories_path), requests)
    engine = make_engine(stories_path, speculative=draft(small), worker_process=True)
    try:
        speculated, _ = run(engine, requests)
        assert engine.scheduler.spec.counters.num_accepted_tokens > 0
        assert_same(speculated, plain)
    finally:
        engine.shutdown()


def test_a_draft_of_another_vocabulary_is_refused_before_the_workers_load(stories_path, tmp_path):
    other = truncated_copy(stories_path, tmp_path / "other-vocab", 2, vocab_size=1024)
    before = set(multiprocessing.active_children())
    with pytest.raises(ModelLoadError, match="^--speculative-config: model: the draft's vocabulary has 1024"):
        make_engine(stories_path, speculative=draft(other), **TP2)
    assert set(multiprocessing.active_children()) <= before  # no worker was left running


@pytest.fixture
def tp2_server(stories_path):
    config = EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8),
        server=ServerConfig(host="127.0.0.1", port=0, drain_seconds=10),
        telemetry=TelemetryConfig(metrics_port=0, metrics_vllm_compat=True),
        parallel=ParallelConfig(tensor_parallel_size=2),
        speculative=SpeculativeConfig("draft_model", 3, model=str(stories_path), min_acceptance_rate=0.0),
    )
    thread = ServerThread(config).start()
    yield thread
    thread.stop()


def test_get_load_and_the_counters_count_the_drafts_proposals_with_tp2(tp2_server, story):
    stub = tp2_server.stub()
    before = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    request = pb.GenerateRequest(
        request_id="grounded",
        token_ids=pb.TokenIds(ids=grounded(story)),
        sampling=pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    )
    messages = list(stub.Generate(request, timeout=120))
    assert messages[-1].usage.completion_tokens == 24
    load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    accepted = load.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    proposed = load.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    assert accepted == proposed > 0  # the target as its own draft: every proposal holds
    assert load.spec_decode_acceptance_rate == pytest.approx(
        load.spec_decode_accepted_tokens / load.spec_decode_draft_tokens, rel=1e-6
    )
    metrics = scrape(tp2_server.metrics_url)
    assert metrics.value("conduit_engine_spec_decode_num_draft_tokens_total") == load.spec_decode_draft_tokens
    assert metrics.value("conduit_engine_spec_decode_num_accepted_tokens_total") == (
        load.spec_decode_accepted_tokens
    )
    drafts = metrics.value("conduit_engine_spec_decode_num_drafts_total")
    per_pos = [
        metrics.value("conduit_engine_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(3)
    ]
    # Every proposal held: each position was accepted as often as it was proposed (a proposal is cut
    # short only where max_tokens ends the request).
    assert per_pos[0] == drafts and per_pos == sorted(per_pos, reverse=True)
    assert sum(per_pos) == load.spec_decode_accepted_tokens
    model = {"model_name": "stories260K", "engine": "0"}
    assert metrics.value("vllm:spec_decode_num_accepted_tokens_total", **model) == sum(per_pos)
    assert load.kv_blocks_used == 0 and load.running_requests == 0
