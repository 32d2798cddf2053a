"""Prometheus metrics of one gateway app (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """Every metric the gateway exports; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "conduit_gateway_requests",
            "HTTP requests by route, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "conduit_gateway_request_duration_seconds",
            "Time from request to the last byte of the response, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_token_seconds = Histogram(
            "conduit_gateway_time_to_first_token_seconds",
            "Time from request to the engine's first message, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generations_in_flight = Gauge(
            "conduit_gateway_generations_in_flight",
            "Generation requests being served now.",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "conduit_gateway_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.completion_tokens = Counter(
            "conduit_gateway_completion_tokens",
            "Tokens generated for finished requests.",
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "conduit_gateway_stream_errors",
            "Streams that ended with an error event, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "conduit_gateway_rejected_requests",
            "Requests refused because the gateway's concurrency limit was full.",
            registry=self.registry,
        )
        self.engine_up = Gauge(
            "conduit_gateway_engine_up",
            "1 when the engine's last health check said SERVING.",
            ["engine"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
