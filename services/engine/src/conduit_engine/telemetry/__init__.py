"""The engine service's metrics and traces, driven by EngineServer through `EngineTelemetry`.

- The Prometheus endpoint (--metrics-port) starts before the model loads and stops after the drain, in
  its own thread, so it answers while loading, serving and draining.
- The observers (metrics, tracing) are attached to the engine core after the warm-up, so the warm-up
  request counts in neither.
- `request_trace` gives each Generate call its trace (tracing on), which the GenerationRequest carries.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, Status, StatusCode
from prometheus_client import start_http_server

from conduit_common.tracing import otlp_tracer_provider
from conduit_engine.config import TelemetryConfig
from conduit_engine.engine.llm_engine import EngineStats
from conduit_engine.telemetry.metrics import EngineMetrics, KvCacheInfo
from conduit_engine.telemetry.tracing import EngineTracing, RequestTrace, kv_transfer_span

if TYPE_CHECKING:  # the async engine imports kv_transfer_span from here
    from conduit_engine.engine.async_engine import AsyncEngine

__all__ = ["EngineTelemetry", "RequestTrace", "kv_transfer_span"]

log = logging.getLogger(__name__)

SERVICE_NAME = "conduit-engine"
# A scrape waits at most this long for the engine thread to finish its step and read its state.
STATS_TIMEOUT_S = 2.0


class EngineTelemetry:
    """Metrics (when config.metrics_port is set) and tracing (config.otlp_endpoint, or `tracer_provider`,
    which tests give to read spans in memory) of one engine server."""

    def __init__(
        self, config: TelemetryConfig, host: str, tracer_provider: TracerProvider | None = None
    ) -> None:
        self.config = config
        self.host = host
        self.metrics = EngineMetrics(config.metrics_vllm_compat) if config.metrics_port is not None else None
        self._owns_provider = tracer_provider is None and config.otlp_endpoint is not None
        if self._owns_provider and config.otlp_endpoint is not None:
            tracer_provider = otlp_tracer_provider(SERVICE_NAME, config.otlp_endpoint)
        self._provider = tracer_provider
        self.tracing: EngineTracing | None = None
        self.metrics_port: int | None = None
        self._http: tuple[WSGIServer, threading.Thread] | None = None
        self._engine: AsyncEngine | None = None
        self._last_stats: EngineStats | None = None

    def start_endpoint(self) -> None:
        """Serve /metrics (raises OSError when the port is taken)."""
        if self.metrics is None or self.config.metrics_port is None:
            return
        port = self.config.metrics_port
        try:
            self._http = start_http_server(port, addr=self.host, registry=self.metrics.registry)
        except OSError as exc:
            raise OSError(f"--metrics-port: cannot listen on {self.host}:{port}: {exc}") from exc
        self.metrics_port = self._http[0].server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", self.host, self.metrics_port)

    async def attach(self, engine: AsyncEngine) -> None:
        """Start observing `engine` (after its warm-up); its state gauges read it from now on."""
        core = engine.core
        observers: list[Any] = []
        if self.metrics is not None:
            self._engine = engine
            cache_info = {
                "block_size": str(core.block_size),
                "num_gpu_blocks": str(core.num_blocks),
                "enable_prefix_caching": str(core.config.cache.enable_prefix_caching),
                "cache_dtype": core.config.cache.kv_cache_dtype,
            }
            kv_cache = KvCacheInfo(core.kv_layout.dtype, core.block_size, core.kv_layout.block_bytes)
            self.metrics.state.bind(self._read_stats, core.model_name, cache_info, kv_cache)
            observers.append(self.metrics)
        if self._provider is not None:
            self.tracing = EngineTracing(self._provider, core.model_name)
            observers.append(self.tracing)
        await engine.run_sync(lambda: core.observers.extend(observers))

    def set_state(self, state: str) -> None:
        """loading, serving or draining (the conduit_engine_state gauge)."""
        if self.metrics is not None:
            self.metrics.set_state(state)

    def request_trace(self, metadata: Any) -> RequestTrace | None:
        """The trace of one Generate call (None when tracing is off)."""
        return None if self.tracing is None else self.tracing.request_trace(metadata)

    def refused(self, trace: RequestTrace | None, error: BaseException) -> None:
        """End the Generate span of a call refused before its request entered the engine."""
        if trace is not None:
            trace.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            trace.span.end()

    def pull_kv_span(self, metadata: Any, transfer_id: str) -> Span | None:
        """The span of a PullKv served here (None when tracing is off); the caller ends it."""
        return None if self.tracing is None else self.tracing.pull_kv_span(metadata, transfer_id)

    def shutdown(self) -> None:
        """Stop the endpoint and flush the spans (of the provider made here; a given one is the giver's)."""
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
        if self._provider is not None and self._owns_provider:
            self._provider.shutdown()

    def _read_stats(self) -> EngineStats | None:
        # Runs on the endpoint's thread: the stats are read on the engine thread, between two steps.
        engine = self._engine
        if engine is None or not engine.running:
            return None
        try:
            self._last_stats = engine.call_soon(engine.core.stats).result(timeout=STATS_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            log.warning("the engine thread did not answer a metrics scrape within %.0fs", STATS_TIMEOUT_S)
        return self._last_stats
