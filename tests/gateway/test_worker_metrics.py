"""/metrics under --workers: the workers' expositions merged into one (counters and histograms add up,
gauges add up unless every worker measures the same thing, series start at the earliest worker's)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conduit_gateway.workers.metrics_peers import merge_expositions

pytestmark = pytest.mark.unit


def exposition(requests: int, in_flight: int, up: int, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("conduit_gateway_requests", "Requests.", ["route"], registry=registry)
    counter.labels("/v1/completions").inc(requests)
    Gauge("conduit_gateway_generations_in_flight", "In flight.", registry=registry).set(in_flight)
    up_gauge = Gauge("conduit_gateway_engine_up", "Up.", ["engine"], registry=registry)
    up_gauge.labels("e:1").set(up)
    histogram = Histogram(
        "conduit_gateway_request_duration_seconds", "Time.", buckets=(1, 2), registry=registry
    )
    for latency in latencies:
        histogram.observe(latency)
    return generate_latest(registry).decode()


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_workers_metrics_merge_into_their_sum():
    first = exposition(requests=3, in_flight=2, up=1, latencies=[0.5])
    second = exposition(requests=4, in_flight=1, up=1, latencies=[1.5, 3])
    merged = samples(merge_expositions([first, second]))
    route = (("route", "/v1/completions"),)
    assert merged[("conduit_gateway_requests_total", route)] == 7
    assert merged[("conduit_gateway_generations_in_flight", ())] == 3
    assert merged[("conduit_gateway_engine_up", (("engine", "e:1"),))] == 1  # one engine, up
    assert merged[("conduit_gateway_request_duration_seconds_bucket", (("le", "1.0"),))] == 1
    assert merged[("conduit_gateway_request_duration_seconds_bucket", (("le", "2.0"),))] == 2
    assert merged[("conduit_gateway_request_duration_seconds_bucket", (("le", "+Inf"),))] == 3
    assert merged[("conduit_gateway_request_duration_seconds_count", ())] == 3
    assert merged[("conduit_gateway_request_duration_seconds_sum", ())] == 5.0
    assert merged[("conduit_gateway_workers", ())] == 2
    created = [
        samples(text.encode())[("conduit_gateway_requests_created", route)] for text in (first, second)
    ]
    assert merged[("conduit_gateway_requests_created", route)] == min(created)


def test_a_series_only_one_worker_has_is_kept():
    first = exposition(requests=1, in_flight=0, up=1, latencies=[])
    registry = CollectorRegistry()
    Counter("conduit_gateway_retries", "Retries.", ["code"], registry=registry).labels("UNAVAILABLE").inc()
    merged = samples(merge_expositions([first, generate_latest(registry).decode()]))
    assert merged[("conduit_gateway_retries_total", (("code", "UNAVAILABLE"),))] == 1
    assert merged[("conduit_gateway_requests_total", (("route", "/v1/completions"),))] == 1
