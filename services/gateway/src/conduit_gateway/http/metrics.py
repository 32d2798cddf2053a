"""Prometheus metrics of one gateway app (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conduit_common.metric_buckets import TOKEN_GAP_SECONDS
from conduit_gateway.routing.node import EngineNode

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """Every metric the gateway exports; `render()` is the /metrics body."""

    def __init__(self, nodes: Callable[[], Sequence[EngineNode]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(NodeCollector(nodes))
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
            "Time from request to the engine's first message (its first token), by endpoint and model.",
            ["endpoint", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_seconds = Histogram(
            "conduit_gateway_inter_token_latency_seconds",
            "Time between consecutive token messages of a choice from the engine, by model.",
            ["model"],
            buckets=TOKEN_GAP_SECONDS,
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
        self.migrations = Counter(
            "conduit_gateway_migrations",
            "Running streams moved to another engine, by why: unavailable (the stream broke or its engine "
            "was lost), engine_error, or drain (handed back at the end of a drain).",
            ["reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "conduit_gateway_retries",
            "Requests sent to another engine after a refusal before their first token, by gRPC status.",
            ["code"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class NodeCollector(Collector):
    """Per-node series read from the pool at scrape time, so a node that leaves the pool leaves /metrics."""

    def __init__(self, nodes: Callable[[], Sequence[EngineNode]]) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[Metric]:
        nodes = self._nodes()
        up = GaugeMetricFamily(
            "conduit_gateway_engine_up", "1 when the engine's health says SERVING.", labels=["engine"]
        )
        routable = GaugeMetricFamily(
            "conduit_gateway_node_routable",
            "1 when the node receives new requests (SERVING and not draining).",
            labels=["node"],
        )
        in_flight = GaugeMetricFamily(
            "conduit_gateway_node_in_flight", "This gateway's requests open on the node.", labels=["node"]
        )
        routed = CounterMetricFamily(
            "conduit_gateway_node_routed", "Requests sent to the node (retries included).", labels=["node"]
        )
        failures = CounterMetricFamily(
            "conduit_gateway_node_failures",
            "Requests the node failed (engine-side gRPC errors, before or after the first token).",
            labels=["node"],
        )
        ejections = CounterMetricFamily(
            "conduit_gateway_node_ejections",
            "Times the node left the rotation because it stopped serving or could not be reached.",
            labels=["node"],
        )
        for node in nodes:
            up.add_metric([node.address], 1 if node.serving else 0)
            routable.add_metric([node.address], 1 if node.routable else 0)
            in_flight.add_metric([node.address], node.in_flight)
            routed.add_metric([node.address], node.routed)
            failures.add_metric([node.address], node.failures)
            ejections.add_metric([node.address], node.ejections)
        yield from (up, routable, in_flight, routed, failures, ejections)
        yield from _kv_index_metrics(nodes)


def _kv_index_metrics(nodes: Sequence[EngineNode]) -> Iterator[Metric]:
    """kv_aware: each engine's part of the KV index, its event stream, and how well it predicted."""
    indexed = [(node, node.kv_index.peek(node.address)) for node in nodes if node.kv_index is not None]
    if not indexed:
        return
    blocks = GaugeMetricFamily(
        "conduit_gateway_kv_index_blocks",
        "Cached blocks of the engine in the KV index (0 while its snapshot is not in).",
        labels=["engine"],
    )
    current = GaugeMetricFamily(
        "conduit_gateway_kv_index_current",
        "1 when the engine's event snapshot is in and no batch was missed since.",
        labels=["engine"],
    )
    lag = GaugeMetricFamily(
        "conduit_gateway_kv_event_lag_seconds",
        "Age of the engine's last KV event batch when the index applied it.",
        labels=["engine"],
    )
    resubscribes = CounterMetricFamily(
        "conduit_gateway_kv_event_resubscribes",
        "Times the gateway subscribed again to the engine's KV events (gap, broken stream, restart).",
        labels=["engine"],
    )
    predictions = CounterMetricFamily(
        "conduit_gateway_kv_predictions",
        "Requests kv_aware routed to the engine with a predicted number of cached prompt blocks.",
        labels=["engine"],
    )
    predicted = CounterMetricFamily(
        "conduit_gateway_kv_prediction_blocks",
        "Cached prompt blocks per request, summed: predicted (the index), actual (the engine's "
        "cached_tokens / block size), agreed (min of both) and union (max of both); accuracy is "
        "agreed / union.",
        labels=["engine", "kind"],
    )
    for node, entry in indexed:
        address = node.address
        if entry is None:
            blocks.add_metric([address], 0)
            current.add_metric([address], 0)
            continue
        blocks.add_metric([address], len(entry.hashes) if entry.current else 0)
        current.add_metric([address], 1 if entry.current else 0)
        lag.add_metric([address], entry.lag_s)
        resubscribes.add_metric([address], entry.resubscribes)
        predictions.add_metric([address], entry.predictions)
        for kind, value in (
            ("predicted", entry.predicted_blocks),
            ("actual", entry.actual_blocks),
            ("agreed", entry.agreed_blocks),
            ("union", entry.union_blocks),
        ):
            predicted.add_metric([address, kind], value)
    yield from (blocks, current, lag, resubscribes, predictions, predicted)
