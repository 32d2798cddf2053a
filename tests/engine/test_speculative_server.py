"""Speculative decoding seen from outside a real stories260K engine server: the Prometheus counters
(conduit_engine_spec_decode_* and, with --metrics-vllm-compat, vLLM's vllm:spec_decode_*) and the
acceptance rate in GetLoad, on a prompt whose greedy continuation repeats a passage of it."""

from __future__ import annotations

import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    TelemetryConfig,
)
from conduit_engine.speculation.config import SpeculativeConfig
from tests.engine.support.server_thread import ServerThread
from tests.support.prometheus import scrape

pytestmark = pytest.mark.integration

# "Once upon a time, there was a little girl named Lily. She loved to play outside in the park." then
# BOS and its first six tokens again: the model repeats the sentence, n-gram lookup proposes it.
STORY = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]
STORY += [410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426]


@pytest.fixture
def engine(stories_path):
    config = EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8),
        server=ServerConfig(host="127.0.0.1", port=0, drain_seconds=10),
        telemetry=TelemetryConfig(metrics_port=0, metrics_vllm_compat=True),
        speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3),
    )
    thread = ServerThread(config).start()
    yield thread
    thread.stop()


def test_counters_and_get_load_report_the_proposals(engine):
    stub = engine.stub()
    before = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    request = pb.GenerateRequest(
        request_id="grounded",
        token_ids=pb.TokenIds(ids=[1, *STORY, 1, *STORY[:6]]),
        sampling=pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    )
    messages = list(stub.Generate(request, timeout=60))
    assert messages[-1].usage.completion_tokens == 24
    load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.spec_decode_accepted_tokens > before.spec_decode_accepted_tokens
    assert load.spec_decode_draft_tokens >= load.spec_decode_accepted_tokens
    assert load.spec_decode_acceptance_rate == pytest.approx(
        load.spec_decode_accepted_tokens / load.spec_decode_draft_tokens, rel=1e-6
    )
    metrics = scrape(engine.metrics_url)
    drafts = metrics.value("conduit_engine_spec_decode_num_drafts_total")
    assert 0 < drafts <= metrics.value("conduit_engine_spec_decode_num_draft_tokens_total")
    assert metrics.value("conduit_engine_spec_decode_num_draft_tokens_total") == load.spec_decode_draft_tokens
    accepted = metrics.value("conduit_engine_spec_decode_num_accepted_tokens_total")
    assert accepted == load.spec_decode_accepted_tokens
    per_pos = [
        metrics.value("conduit_engine_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(3)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    model = {"model_name": "stories260K", "engine": "0"}
    assert metrics.value("vllm:spec_decode_num_accepted_tokens_total", **model) == accepted
    assert metrics.value("vllm:spec_decode_num_drafts_total", **model) == drafts
    assert (
        metrics.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0", **model)
        == per_pos[0]
    )
