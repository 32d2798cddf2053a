"""The engine's WeightedHistogram: many equal observations in one call, the standard exposition."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conduit_engine.telemetry.weighted_histogram import WeightedHistogram

pytestmark = pytest.mark.unit

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_weighted_observations_equal_as_many_single_ones():
    weighted_registry, single_registry = CollectorRegistry(), CollectorRegistry()
    weighted = WeightedHistogram("gap_seconds", "Gaps.", BUCKETS)
    weighted_registry.register(weighted)
    single = Histogram("gap_seconds", "Gaps.", buckets=BUCKETS, registry=single_registry)
    # Bounds are inclusive (le): 0.01 falls in the 0.01 bucket; 5 only in +Inf.
    for value, count in ((0.0005, 3), (0.01, 2), (0.05, 4), (5.0, 1)):
        weighted.observe(value, count)
        for _ in range(count):
            single.observe(value)
    assert _samples(weighted_registry) == _samples(single_registry)
    samples = _samples(weighted_registry)
    assert samples[("gap_seconds_bucket", "0.01")] == 5
    assert samples[("gap_seconds_count", "")] == 10
    assert samples[("gap_seconds_sum", "")] == pytest.approx(0.0005 * 3 + 0.02 + 0.2 + 5)
