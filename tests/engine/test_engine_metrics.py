"""The engine's Prometheus endpoint (--metrics-port) on a real stories260K engine: values of known work,
vLLM's names with vLLM's meanings, and an endpoint that answers while loading and while draining."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading

import grpc
import httpx
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc
from conduit_engine import telemetry
from conduit_engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    TelemetryConfig,
)
from conduit_engine.entrypoints import server as server_module
from tests.engine.support.server_thread import ServerThread
from tests.support.polling import wait_for
from tests.support.prometheus import scrape
from tests.support.stories import KNOWN_STORY, MODEL, PROMPT, PROMPT_IDS

pytestmark = pytest.mark.integration

NUM_BLOCKS = 64


def _config(stories_path, *, vllm_compat: bool = True, num_blocks: int = NUM_BLOCKS) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=num_blocks),
        # One forward pass per step: the step counts below are exact (decode bursts follow timing).
        scheduler=SchedulerConfig(max_num_seqs=8, max_decode_steps=1),
        server=ServerConfig(host="127.0.0.1", port=0, drain_seconds=10),
        telemetry=TelemetryConfig(metrics_port=0, metrics_vllm_compat=vllm_compat),
    )


@pytest.fixture
def engine(stories_path):
    thread = ServerThread(_config(stories_path)).start()
    yield thread
    thread.stop()


def _generate(
    stub: engine_pb2_grpc.EngineStub, max_tokens: int, request_id: str
) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        request_id=request_id,
        text=PROMPT,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return list(stub.Generate(request, timeout=60))


def _load(stub: engine_pb2_grpc.EngineStub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest(), timeout=10)


def test_counters_and_histograms_after_five_requests_of_sixteen_tokens(engine):
    stub = engine.stub()
    for i in range(5):
        messages = _generate(stub, 16, f"five-{i}")
        assert messages[-1].usage.completion_tokens == 16
    metrics = scrape(engine.metrics_url)
    # The warm-up's tokens are not counted: observers are attached after it.
    assert metrics.value("conduit_engine_generation_tokens_total") == 80
    assert metrics.value("conduit_engine_prompt_tokens_total") == 5 * len(PROMPT_IDS)
    assert metrics.value("conduit_engine_requests_finished_total", finish_reason="length") == 5
    assert metrics.value("conduit_engine_requests_finished_total", finish_reason="stop") == 0
    assert metrics.value("conduit_engine_aborts_total", stage="decode") == 0
    assert metrics.value("conduit_engine_preemptions_total") == 0
    for name in (
        "conduit_engine_time_to_first_token_seconds",
        "conduit_engine_e2e_request_latency_seconds",
        "conduit_engine_request_queue_time_seconds",
    ):
        assert metrics.value(f"{name}_count") == 5
    assert metrics.value("conduit_engine_inter_token_latency_seconds_count") == 5 * 15
    assert metrics.value("conduit_engine_request_generation_tokens_sum") == 80
    assert metrics.value("conduit_engine_request_prompt_tokens_sum") == 5 * len(PROMPT_IDS)
    # One request at a time: a prefill step, then fifteen decode steps of one sequence, five times.
    assert metrics.value("conduit_engine_step_duration_seconds_count", phase="prefill") == 5
    assert metrics.value("conduit_engine_step_duration_seconds_count", phase="decode") == 5 * 15
    assert metrics.value("conduit_engine_batch_size_sum") == 80
    assert metrics.value("conduit_engine_state", state="serving") == 1
    # Afterwards: nothing running or waiting, every block free, and GetLoad says the same.
    load = _load(stub)
    assert metrics.value("conduit_engine_requests_running") == load.running_requests == 0
    assert metrics.value("conduit_engine_requests_waiting") == load.waiting_requests == 0
    assert metrics.value("vllm:num_requests_running", model_name=MODEL, engine="0") == 0
    assert metrics.value("vllm:num_requests_waiting", model_name=MODEL, engine="0") == 0
    assert metrics.value("conduit_engine_kv_blocks_total") == load.kv_blocks_total == NUM_BLOCKS
    assert metrics.value("conduit_engine_kv_blocks_used") == load.kv_blocks_used == 0
    assert metrics.value("conduit_engine_kv_blocks_cached") == load.kv_blocks_cached
    assert metrics.value("conduit_engine_prefix_cache_hit_rate") == pytest.approx(load.prefix_cache_hit_rate)


def _open_stream(stub: engine_pb2_grpc.EngineStub, max_tokens: int) -> grpc.Future:
    """A Generate stream whose first token has arrived: the request holds KV blocks now."""
    request = pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    call = stub.Generate(request, timeout=60)
    next(call)
    return call


def _hold_engine_thread(engine: ServerThread) -> threading.Event:
    """Fault injection: the engine thread stops between two steps until the returned event is set."""
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        inside.set()
        release.wait(timeout=60)

    engine.server.async_engine.call_soon(hold)
    assert inside.wait(timeout=60)
    return release


def test_kv_fraction_matches_get_load_while_requests_run(engine):
    stub = engine.stub()
    calls = [_open_stream(stub, 300) for _ in range(2)]
    release = _hold_engine_thread(engine)
    try:
        # Both reads queue behind the held step and then run one after the other, with no step between.
        load_future = stub.GetLoad.future(pb.GetLoadRequest(), timeout=30)
        scraped = {}
        scraper = threading.Thread(target=lambda: scraped.update(metrics=scrape(engine.metrics_url)))
        scraper.start()
        wait_for(lambda: engine.server.async_engine.pending_commands == 2, "both reads to be queued")
    finally:
        release.set()
    load = load_future.result()
    scraper.join(timeout=30)
    metrics = scraped["metrics"]
    fraction = load.kv_blocks_used / load.kv_blocks_total
    assert 0 < fraction < 1
    assert metrics.value("conduit_engine_kv_cache_usage_ratio") == fraction
    # vLLM's "perc" is a fraction too ("1 means 100 percent usage").
    assert metrics.value("vllm:kv_cache_usage_perc", model_name=MODEL, engine="0") == fraction
    assert metrics.value("conduit_engine_kv_blocks_used") == load.kv_blocks_used
    assert metrics.value("conduit_engine_requests_running") == load.running_requests == 2
    assert metrics.value("vllm:num_requests_running", model_name=MODEL) == 2
    assert metrics.value("vllm:num_requests_waiting", model_name=MODEL) == load.waiting_requests == 0
    for call in calls:
        call.cancel()


def test_vllm_cache_config_info_describes_the_cache(engine):
    info = engine.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    metrics = scrape(engine.metrics_url)
    (labels,) = metrics.labels("vllm:cache_config_info")
    assert labels["block_size"] == str(info.block_size)
    assert labels["num_gpu_blocks"] == str(info.num_kv_blocks) == str(NUM_BLOCKS)
    assert labels["engine"] == "0"
    assert metrics.value("vllm:cache_config_info") == 1


def test_aborted_streams_count_as_aborts(engine):
    stub = engine.stub()
    call = stub.Generate(
        pb.GenerateRequest(
            request_id="to-abort",
            text=PROMPT,
            sampling=pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
        ),
        timeout=60,
    )
    next(call)  # the first token: the request is decoding
    call.cancel()
    wait_for(
        lambda: scrape(engine.metrics_url).value("conduit_engine_aborts_total", stage="decode") == 1,
        "the abort",
    )
    metrics = scrape(engine.metrics_url)
    assert metrics.value("conduit_engine_requests_finished_total", finish_reason="abort") == 1
    assert metrics.value("conduit_engine_requests_running") == 0


def test_endpoint_answers_while_loading_and_without_vllm_names_by_default(stories_path, monkeypatch):
    loading = threading.Event()
    release = threading.Event()
    real_engine = server_module.LLMEngine

    def held_load(*args):  # fault injection: a model that takes as long as the test wants to load
        loading.set()
        release.wait(timeout=60)
        return real_engine(*args)  # the config and the workers (None: the model runs in process)

    monkeypatch.setattr(server_module, "LLMEngine", held_load)
    thread = ServerThread(_config(stories_path, vllm_compat=False)).start(wait=False)
    try:
        assert loading.wait(timeout=60)
        metrics = scrape(thread.metrics_url)
        assert metrics.value("conduit_engine_state", state="loading") == 1
        assert metrics.value("conduit_engine_state", state="serving") == 0
        assert "conduit_engine_requests_running" not in metrics.names  # no engine to read yet
        release.set()
        thread.wait_started()
        metrics = scrape(thread.metrics_url)
        assert metrics.value("conduit_engine_state", state="serving") == 1
        assert metrics.value("conduit_engine_requests_running") == 0
        assert not [name for name in metrics.names if name.startswith("vllm:")]
    finally:
        release.set()
        thread.stop()


def test_endpoint_answers_while_draining_and_closes_after(engine, monkeypatch):
    monkeypatch.setattr(telemetry, "STATS_TIMEOUT_S", 0.2)  # scrapes while the engine thread is held
    stub = engine.stub()
    call = _open_stream(stub, 300)
    release = _hold_engine_thread(engine)  # the stream stays open while draining
    drained = asyncio.run_coroutine_threadsafe(engine.server.drain_and_stop(), engine.loop)
    try:
        wait_for(
            lambda: scrape(engine.metrics_url).value("conduit_engine_state", state="draining") == 1,
            "draining",
        )
        metrics = scrape(engine.metrics_url)
        assert metrics.value("conduit_engine_state", state="serving") == 0
        assert not drained.done()
    finally:
        release.set()
    drained.result(timeout=60)
    assert list(call)[-1].finished
    with pytest.raises(httpx.TransportError):
        httpx.get(engine.metrics_url, timeout=5)
    with pytest.raises(grpc.RpcError):
        _load(stub)


def test_a_taken_metrics_port_stops_the_start_naming_the_flag(stories_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = dataclasses.replace(
            _config(stories_path),
            telemetry=TelemetryConfig(metrics_port=port),
        )
        with pytest.raises(OSError, match=f"--metrics-port: cannot listen on 127.0.0.1:{port}"):
            ServerThread(config).start()


@pytest.fixture
def roomy_engine(stories_path):
    # A full batch of long generations (8 x 500 tokens: 256 blocks) never runs short of blocks: a step
    # that lacks them releases the waiting request's hold first, which would end what is measured here.
    thread = ServerThread(_config(stories_path, num_blocks=512)).start()
    yield thread
    thread.stop()


def test_a_waiting_request_holds_its_cached_prefix_until_it_is_aborted(roomy_engine):
    engine = roomy_engine
    stub = engine.stub()
    prompt = KNOWN_STORY + " The end."
    messages = _generate_text(stub, prompt, 1, "warm")
    cached_blocks = (messages[-1].usage.prompt_tokens - 1) // 16
    assert cached_blocks >= 3
    # Fill the batch (max_num_seqs 8) with other prompts, so the next request waits in the queue.
    fillers = [
        stub.Generate(
            pb.GenerateRequest(
                text=f"Lily {i}", sampling=pb.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
            ),
            timeout=60,
        )
        for i in range(8)
    ]
    for call in fillers:
        next(call)
    waiting = stub.Generate(
        pb.GenerateRequest(
            request_id="waiting", text=prompt, sampling=pb.SamplingParams(max_tokens=4, temperature=0)
        ),
        timeout=60,
    )
    try:
        wait_for(lambda: _load(stub).waiting_requests == 1, "the request to wait")
        # Its cached blocks are held (a reference each, within the budget of half the cache).
        assert scrape(engine.metrics_url).value("conduit_engine_kv_blocks_held") == cached_blocks
        assert stub.Abort(pb.AbortRequest(request_id="waiting"), timeout=10).aborted
        wait_for(lambda: _load(stub).waiting_requests == 0, "the abort")
        assert scrape(engine.metrics_url).value("conduit_engine_kv_blocks_held") == 0
    finally:
        waiting.cancel()
        for call in fillers:
            call.cancel()
    wait_for(lambda: _load(stub).kv_blocks_used == 0, "every block back")
    assert scrape(engine.metrics_url).value("conduit_engine_kv_blocks_held") == 0


def _generate_text(
    stub: engine_pb2_grpc.EngineStub, text: str, max_tokens: int, request_id: str
) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        request_id=request_id, text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    return list(stub.Generate(request, timeout=60))
