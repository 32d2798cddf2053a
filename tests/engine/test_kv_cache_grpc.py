"""Prefix caching, preemption and cache-size admission through a real gRPC server on 127.0.0.1.

Two servers on stories260K: one with prefix caching and room to spare, one with prefix caching off
and a cache of only 8 blocks of 16 tokens, so that a request with three choices must preempt.
"""

from __future__ import annotations

import random

import grpc
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from tests.engine.support.model_factory import greedy_with, load_hf
from tests.engine.support.server_thread import ServerThread

pytestmark = pytest.mark.integration

WARMUP_PROMPT_TOKENS = 1  # the server's warm-up request is the BOS token alone


def start_server(model, *, num_blocks: int, prefix_caching: bool, max_num_seqs: int = 8) -> ServerThread:
    config = EngineConfig(
        model=ModelConfig(path=str(model)),
        cache=CacheConfig(num_blocks=num_blocks, block_size=16, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        server=ServerConfig(host="127.0.0.1", port=0, drain_seconds=5),
    )
    return ServerThread(config).start()


@pytest.fixture(scope="module")
def roomy(stories_path):
    srv = start_server(stories_path, num_blocks=64, prefix_caching=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tight(stories_path):
    srv = start_server(stories_path, num_blocks=8, prefix_caching=False)
    yield srv
    srv.stop()


def generate(stub, prompt: list[int], max_tokens: int, **sampling) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling),
    )
    return list(stub.Generate(req))


def shared_prefix_prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(4)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(47)]  # three blocks of 16
    first = prefix + [rng.randrange(3, 512) for _ in range(5)]
    second = prefix + [rng.randrange(3, 512) for _ in range(7)]
    return first, second


def test_second_request_reports_the_shared_three_block_prefix_as_cached(roomy, stories_path):
    stub = roomy.stub()
    first, second = shared_prefix_prompts()
    a = generate(stub, first, 4)
    b = generate(stub, second, 4)
    assert [m.usage.cached_tokens for m in a] == [0] * len(a)
    assert [m.usage.cached_tokens for m in b] == [48] * len(b)
    assert b[-1].usage.prompt_tokens == 55 and b[-1].usage.completion_tokens == 4
    assert [t for m in b for t in m.token_ids] == greedy_with(load_hf(stories_path), second, 4)
    load = stub.GetLoad(pb.GetLoadRequest())
    assert (load.kv_blocks_total, load.kv_blocks_used, load.kv_blocks_cached) == (64, 0, 3)
    assert load.prefix_cache_hit_rate == pytest.approx(48 / (WARMUP_PROMPT_TOKENS + 53 + 55), rel=1e-6)
    assert (load.running_requests, load.waiting_requests) == (0, 0)


def test_prefix_caching_off_reports_nothing_cached(tight):
    stub = tight.stub()
    first, second = shared_prefix_prompts()
    for prompt in (first, second, first):
        assert {m.usage.cached_tokens for m in generate(stub, prompt, 4)} == {0}
    load = stub.GetLoad(pb.GetLoadRequest())
    assert (load.kv_blocks_total, load.kv_blocks_used, load.kv_blocks_cached) == (8, 0, 0)
    assert load.prefix_cache_hit_rate == 0.0


def test_preempted_choices_stream_exactly_the_uninterrupted_tokens(tight, stories_path, monkeypatch):
    # Three greedy choices of 20 + 60 tokens need 5 blocks each, 15 in all; the cache has 8, so
    # choices are preempted and recomputed. Count the preemptions to prove it happened.
    scheduler = tight.server.async_engine.core.scheduler
    preempted: list[int] = []
    real_schedule = scheduler.schedule

    def counting_schedule():
        out = real_schedule()
        preempted.extend(seq.index for seq in out.preempted)
        return out

    monkeypatch.setattr(scheduler, "schedule", counting_schedule)
    prompt = [1] + [random.Random(5).randrange(3, 512) for _ in range(19)]
    msgs = generate(tight.stub(), prompt, 60, n=3)
    expected = greedy_with(load_hf(stories_path), prompt, 60)
    assert preempted
    for index in range(3):
        mine = [m for m in msgs if m.index == index]
        assert [t for m in mine for t in m.token_ids] == expected, index
        assert [m.finished for m in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 180
    assert tight.stub().GetLoad(pb.GetLoadRequest()).kv_blocks_used == 0


def test_request_needing_more_blocks_than_the_cache_has_is_invalid_argument(tight):
    stub = tight.stub()
    # 100 + 40 tokens = 9 blocks of 16; the cache has 8 (the model's context, 512, would allow it).
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, [1] * 100, 40)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "max_tokens: prompt + max_tokens needs 9 KV blocks but the cache has 8"
    # Refused up front: nothing was queued, and a request that fits still runs.
    load = stub.GetLoad(pb.GetLoadRequest())
    assert (load.waiting_requests, load.running_requests, load.kv_blocks_used) == (0, 0, 0)
    assert len([t for m in generate(stub, [1] * 100, 28) for t in m.token_ids]) == 28
