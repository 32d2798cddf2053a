"""The inter-token histogram fed in batches (handlers/token_gaps.py) holds exactly what observing each gap
would: the same bucket counts, count and sum, once the stream has flushed, and at most FLUSH_EVERY gaps
late before that."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from conduit_common.metric_buckets import TOKEN_GAP_SECONDS
from conduit_gateway.handlers.token_gaps import FLUSH_EVERY, TokenGaps

pytestmark = pytest.mark.unit


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if not sample.name.endswith("_created")
    }


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("gaps", "gaps", ["model"], buckets=TOKEN_GAP_SECONDS, registry=registry)


def test_batched_gaps_equal_gaps_observed_one_by_one():
    rng = random.Random(7)
    # Every bucket's edges too: a gap equal to a bound falls in that bound's bucket, as observe puts it.
    gaps = [rng.expovariate(50) for _ in range(1000)] + list(TOKEN_GAP_SECONDS) + [0.0, 1e9]
    one_by_one, reference = _histogram()
    batched, histogram = _histogram()
    recorder = TokenGaps(histogram.labels("m"))
    for gap in gaps:
        reference.labels("m").observe(gap)
        recorder.add(gap)
    recorder.flush()
    got, want = _samples(batched), _samples(one_by_one)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_gaps_reach_the_histogram_every_flush_every_and_at_the_flush():
    registry, histogram = _histogram()
    recorder = TokenGaps(histogram.labels("m"))

    def count() -> float:
        return _samples(registry)[("gaps_count", (("model", "m"),))]

    for _ in range(FLUSH_EVERY - 1):
        recorder.add(0.01)
    assert count() == 0
    recorder.add(0.01)
    assert count() == FLUSH_EVERY
    recorder.add(0.02)
    recorder.flush()
    recorder.flush()  # nothing pending: adds nothing
    assert count() == FLUSH_EVERY + 1
