"""LoRA metrics of a real engine on stories260K: conduit_engine_lora_* per adapter, and with
--metrics-vllm-compat vllm:lora_requests_info as the Inference Extension's model-server protocol reads it
(running_lora_adapters, waiting_lora_adapters: comma-separated names; max_lora; the value a timestamp)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from conduit_engine.config import LoraConfig, TelemetryConfig
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.telemetry.metrics import EngineStateCollector
from tests.engine.support.harness import greedy, make_engine
from tests.engine.support.lora_factory import make_adapter
from tests.engine.support.server_thread import ServerThread, engine_config
from tests.support.prometheus import scrape
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    a1 = make_adapter(stories_path, root / "a1", r=4, seed=1)
    a2 = make_adapter(stories_path, root / "a2", r=4, seed=2)
    config = dataclasses.replace(
        engine_config(stories_path, max_num_seqs=1),  # one request runs, the next waits
        lora=LoraConfig(enable_lora=True, lora_modules=(("a1", str(a1)), ("a2", str(a2))), max_loras=2),
        telemetry=TelemetryConfig(metrics_port=0, metrics_vllm_compat=True),
    )
    srv = ServerThread(config).start()
    yield srv
    srv.stop()


def test_lora_gauges_and_vllm_lora_requests_info(server):
    idle = scrape(server.metrics_url)
    assert idle.value("conduit_engine_lora_max_loras") == 2
    assert idle.value("conduit_engine_lora_adapter_loaded", adapter="a1") == 1
    assert idle.value("conduit_engine_lora_requests_running", adapter="a2") == 0
    (info,) = idle.labels("vllm:lora_requests_info")
    assert info == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert 0 < idle.value("vllm:lora_requests_info") <= time.time()


def test_running_and_waiting_adapters_are_reported_per_adapter(stories_path, tmp_path):
    """Read at one point between steps: a1's request runs (max_num_seqs 1), a2's and a base one wait."""
    a1 = make_adapter(stories_path, tmp_path / "a1", r=4, seed=1)
    a2 = make_adapter(stories_path, tmp_path / "a2", r=4, seed=2)
    lora = LoraConfig(enable_lora=True, lora_modules=(("a1", str(a1)), ("a2", str(a2))), max_loras=2)
    engine = make_engine(stories_path, max_num_seqs=1, lora=lora)
    for rid, adapter in (("r1", "a1"), ("r2", "a2"), ("r3", None)):
        params = greedy(8, ignore_eos=True)
        engine.add_request(GenerationRequest(rid, params, token_ids=list(PROMPT_IDS), lora=adapter))
    engine.step()
    collector = EngineStateCollector(vllm_compat=True)
    collector.bind(engine.stats, "stories260K", {})
    before = time.time()
    families = {family.name: family for family in collector.collect()}
    samples = {
        (name, tuple(sorted(s.labels.items()))): s.value for name, f in families.items() for s in f.samples
    }
    assert samples[("conduit_engine_lora_requests_running", (("adapter", "a1"),))] == 1
    assert samples[("conduit_engine_lora_requests_waiting", (("adapter", "a2"),))] == 1
    assert samples[("conduit_engine_lora_requests_running", (("adapter", "a2"),))] == 0
    ((labels, value),) = [(dict(k[1]), v) for k, v in samples.items() if k[0] == "vllm:lora_requests_info"]
    assert labels == {"max_lora": "2", "running_lora_adapters": "a1", "waiting_lora_adapters": "a2"}
    assert value >= before - 1
