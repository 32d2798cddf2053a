"""The engine's Prometheus metrics: an `EngineObserver` turning step and request records into counters and
histograms, and a collector reading the engine's state (queues, KV blocks) at scrape time.

Every name is under conduit_engine_ (README: "Engine metrics"). With vllm_compat, the state collector also
exports the four vLLM names Kubernetes inference routers read, with vLLM's meanings and labels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conduit_common.metric_buckets import TOKEN_GAP_SECONDS
from conduit_engine.core.sequence import FinishReason
from conduit_engine.core.spec_decode import SpecDecodeCounters
from conduit_engine.engine.llm_engine import EngineStats
from conduit_engine.engine.observer import RequestRecord, StepRecord
from conduit_engine.telemetry.weighted_histogram import WeightedHistogram

STATES = ("loading", "serving", "draining")
ABORT_STAGES = ("queued", "prefill", "decode")

_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 240, 480, 960, 1920, 7680)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineMetrics:
    """The registry of one engine; `render()` is the /metrics body."""

    def __init__(self, vllm_compat: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.state = EngineStateCollector(vllm_compat)
        self.registry.register(self.state)
        self._status = Gauge(
            "conduit_engine_state",
            "1 for the engine's state: loading, serving or draining.",
            ["state"],
            registry=self.registry,
        )
        self._define_counters()
        self._define_request_histograms()
        self._define_step_histograms()
        self.set_state("loading")

    def _define_counters(self) -> None:
        r = self.registry
        self.prompt_tokens = Counter(
            "conduit_engine_prompt_tokens",
            "Prompt tokens of the requests that got their first token (prefix-cached ones included).",
            registry=r,
        )
        self.generation_tokens = Counter("conduit_engine_generation_tokens", "Tokens sampled.", registry=r)
        self.preemptions = Counter(
            "conduit_engine_preemptions",
            "Sequences preempted: their KV blocks freed, to be recomputed.",
            registry=r,
        )
        finished = Counter(
            "conduit_engine_requests_finished",
            "Requests that ended, by finish reason (stop, length, abort, error, kv_handoff).",
            ["finish_reason"],
            registry=r,
        )
        aborts = Counter(
            "conduit_engine_aborts",
            "Requests aborted (client gone or Abort), by where they were: queued, prefill or decode.",
            ["stage"],
            registry=r,
        )
        # Every label value exists from the start, so rates and dashboards see zeros, not gaps.
        self._finished = {reason: finished.labels(reason.value) for reason in FinishReason}
        self._aborts = {stage: aborts.labels(stage) for stage in ABORT_STAGES}

    def _define_request_histograms(self) -> None:
        r = self.registry
        self.ttft = Histogram(
            "conduit_engine_time_to_first_token_seconds",
            "Arrival at the engine to the request's first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = WeightedHistogram(
            "conduit_engine_inter_token_latency_seconds",
            "Time between consecutive tokens of a choice.",
            TOKEN_GAP_SECONDS,
        )
        r.register(self.itl)
        self.e2e = Histogram(
            "conduit_engine_e2e_request_latency_seconds",
            "Arrival at the engine to the request's end.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "conduit_engine_request_queue_time_seconds",
            "Arrival at the engine to the request's first scheduled step.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_length = Histogram(
            "conduit_engine_request_prompt_tokens",
            "Prompt length of the requests that ended.",
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.output_length = Histogram(
            "conduit_engine_request_generation_tokens",
            "Tokens generated for the requests that ended (all choices).",
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )

    def _define_step_histograms(self) -> None:
        r = self.registry
        step = Histogram(
            "conduit_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, model, postprocess), by phase: prefill when the step "
            "computed any prompt token, else decode.",
            ["phase"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self._step = {phase: step.labels(phase) for phase in ("prefill", "decode")}
        self.batch_size = Histogram(
            "conduit_engine_batch_size", "Sequences in one step.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.step_tokens = Histogram(
            "conduit_engine_step_tokens",
            "Tokens computed in one step.",
            buckets=_STEP_TOKEN_BUCKETS,
            registry=r,
        )

    def set_state(self, state: str) -> None:
        for name in STATES:
            self._status.labels(name).set(1 if name == state else 0)

    # ----- EngineObserver (the engine thread) ------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        self._step[record.phase].observe(record.duration)
        self.batch_size.observe(record.num_seqs)
        self.step_tokens.observe(record.num_tokens)
        self.generation_tokens.inc(record.num_generated_tokens)
        if record.num_prompt_tokens:
            self.prompt_tokens.inc(record.num_prompt_tokens)
        if record.num_preemptions:
            self.preemptions.inc(record.num_preemptions)
        for seconds in record.queue_times:
            self.queue_time.observe(seconds)
        for seconds in record.first_token_times:
            self.ttft.observe(seconds)
        for seconds, count in record.token_gaps:
            self.itl.observe(seconds, count)

    def on_request_end(self, record: RequestRecord) -> None:
        self._finished[record.finish_reason].inc()
        if record.finish_reason is FinishReason.ABORT:
            self._aborts[record.stage].inc()
        self.e2e.observe(record.finished - record.arrival)
        self.prompt_length.observe(record.num_prompt_tokens)
        self.output_length.observe(record.num_generated_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class KvCacheInfo:
    """What the KV cache stores and how much: its element dtype (kv_format.py), tokens per block, and
    bytes per block over all layers (scales included)."""

    dtype: str
    block_size: int
    block_bytes: int


class EngineStateCollector(Collector):
    """Gauges of the engine's state, read at scrape time once `bind()` has given it a source."""

    def __init__(self, vllm_compat: bool) -> None:
        self.vllm_compat = vllm_compat
        self._read: Callable[[], EngineStats | None] = lambda: None
        self._model = ""
        self._cache_info: dict[str, str] = {}
        self._kv_cache: KvCacheInfo | None = None

    def bind(
        self,
        read: Callable[[], EngineStats | None],
        model: str,
        cache_info: dict[str, str],
        kv_cache: KvCacheInfo | None = None,
    ) -> None:
        """`read` returns the engine's stats (None when it cannot); `cache_info` is the labels of
        vllm:cache_config_info; `kv_cache` the cache's format and size (its info and capacity gauges)."""
        self._read, self._model, self._cache_info = read, model, cache_info
        self._kv_cache = kv_cache

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        if stats is None:  # loading, or stopped: the state gauge says which
            return
        blocks = stats.blocks
        usage = blocks.used / blocks.total if blocks.total else 0.0
        yield _gauge(
            "conduit_engine_requests_running", "Requests with sequences in the running batch.", stats.running
        )
        yield _gauge("conduit_engine_requests_waiting", "Requests waiting to be scheduled.", stats.waiting)
        yield _gauge(
            "conduit_engine_kv_blocks_used", "KV blocks held by sequences or KV transfers.", blocks.used
        )
        yield _gauge("conduit_engine_kv_blocks_total", "KV blocks of the cache.", blocks.total)
        yield _gauge(
            "conduit_engine_kv_blocks_cached",
            "Free KV blocks still holding reusable prefix content.",
            blocks.cached,
        )
        yield _gauge(
            "conduit_engine_kv_blocks_held",
            "References waiting requests hold on their cached prefix blocks (--queued-hold-fraction).",
            blocks.held,
        )
        yield _gauge("conduit_engine_kv_cache_usage_ratio", "KV blocks used / total (0 to 1).", usage)
        if self._kv_cache is not None:
            yield from _kv_cache_gauges(self._kv_cache, blocks.total)
        yield _gauge(
            "conduit_engine_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.",
            blocks.hit_rate,
        )
        yield CounterMetricFamily(
            "conduit_engine_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            blocks.prefix_queries,
        )
        yield CounterMetricFamily(
            "conduit_engine_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            blocks.prefix_hits,
        )
        yield from _kv_transfers(stats)
        if stats.spec_decode is not None:
            yield from _spec_decode(stats.spec_decode, "conduit_engine_spec_decode_", [], [])
        if stats.max_loras:
            yield from _lora(stats)
        if self.vllm_compat:
            yield from self._vllm(stats, usage)
            if stats.spec_decode is not None:
                labels = ["model_name", "engine"]
                yield from _spec_decode(stats.spec_decode, "vllm:spec_decode_", labels, [self._model, "0"])

    def _vllm(self, stats: EngineStats, usage: float) -> Iterator[Metric]:
        # vLLM's names, help texts and labels (model_name, engine): what the Gateway API Inference
        # Extension and llm-d read. kv_cache_usage_perc is a fraction, as in vLLM ("1 means 100 percent").
        labels = ["model_name", "engine"]
        values = [self._model, "0"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self._cache_info, "engine"],
        )
        info.add_metric([*self._cache_info.values(), "0"], 1)
        yield info
        if stats.max_loras:
            # The Inference Extension's model-server protocol (LoRA affinity): the adapters running and
            # waiting, comma-separated, and the batch's adapter limit; the value is when it was read.
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric(
                [
                    str(stats.max_loras),
                    ",".join(sorted(stats.lora_waiting)),
                    ",".join(sorted(stats.lora_running)),
                ],
                time.time(),
            )
            yield lora


def _spec_decode(
    counters: SpecDecodeCounters, prefix: str, labels: list[str], values: list[str]
) -> Iterator[Metric]:
    """Speculative decoding's totals (vLLM's names and meanings under the vllm: prefix)."""
    for name, doc, value in (
        ("num_drafts", "Proposals verified by the target model.", counters.num_drafts),
        ("num_draft_tokens", "Tokens proposed in those proposals.", counters.num_draft_tokens),
        ("num_accepted_tokens", "Proposed tokens accepted.", counters.num_accepted_tokens),
    ):
        family = CounterMetricFamily(prefix + name, doc, labels=labels)
        family.add_metric(values, value)
        yield family
    per_pos = CounterMetricFamily(
        prefix + "num_accepted_tokens_per_pos",
        "Proposed tokens accepted, by their position in the proposal (0: the first).",
        labels=[*labels, "position"],
    )
    for position, value in enumerate(counters.accepted_per_pos):
        per_pos.add_metric([*values, str(position)], value)
    yield per_pos


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _kv_cache_gauges(kv: KvCacheInfo, total_blocks: int) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "conduit_engine_kv_cache_info",
        "The KV cache's element dtype (the compute dtype, int8 or fp8_e4m3) and bytes per block.",
        labels=["dtype", "block_bytes"],
    )
    info.add_metric([kv.dtype, str(kv.block_bytes)], 1)
    yield info
    yield _gauge(
        "conduit_engine_kv_cache_capacity_tokens",
        "Tokens the KV cache holds (blocks x block size).",
        total_blocks * kv.block_size,
    )
    yield _gauge(
        "conduit_engine_kv_cache_bytes",
        "Bytes of the KV cache (all blocks, scales included).",
        total_blocks * kv.block_bytes,
    )


def _lora(stats: EngineStats) -> Iterator[Metric]:
    """LoRA (--enable-lora): each served adapter, and its requests running and waiting."""
    loaded = GaugeMetricFamily(
        "conduit_engine_lora_adapter_loaded",
        "Served LoRA adapters: 1 when its weights are in memory, 0 when read again at its next request.",
        labels=["adapter"],
    )
    running = GaugeMetricFamily(
        "conduit_engine_lora_requests_running",
        "Requests of a LoRA adapter in the running batch.",
        labels=["adapter"],
    )
    waiting = GaugeMetricFamily(
        "conduit_engine_lora_requests_waiting", "Requests of a LoRA adapter waiting.", labels=["adapter"]
    )
    for name in stats.lora_adapters:
        loaded.add_metric([name], 1.0 if name in stats.lora_in_memory else 0.0)
        running.add_metric([name], stats.lora_running.get(name, 0))
        waiting.add_metric([name], stats.lora_waiting.get(name, 0))
    yield loaded
    yield running
    yield waiting
    yield _gauge(
        "conduit_engine_lora_max_loras", "LoRA adapters one batch may mix (--max-loras).", stats.max_loras
    )


def _kv_transfers(stats: EngineStats) -> Iterator[Metric]:
    """Disaggregation: what a prefill engine holds for decode engines, what a decode engine pulled."""
    yield _gauge(
        "conduit_engine_kv_transfers_pending",
        "KV transfers produced here that no decode engine has pulled, released or let expire yet.",
        stats.kv_transfers_pending,
    )
    yield _gauge("conduit_engine_kv_blocks_pinned", "KV blocks pinned for KV transfers.", stats.blocks.pinned)
    yield CounterMetricFamily(
        "conduit_engine_kv_pulls", "KV transfers pulled into this engine completely.", stats.kv_pulls
    )
    yield CounterMetricFamily(
        "conduit_engine_kv_pulled_bytes", "KV bytes pulled from prefill engines.", stats.kv_bytes_pulled
    )
    yield CounterMetricFamily(
        "conduit_engine_kv_saved_bytes",
        "KV bytes not pulled: the blocks were already in this engine's prefix cache.",
        stats.kv_bytes_saved,
    )
