"""A Prometheus histogram that takes many equal observations in one call: `observe(value, count)`.

prometheus_client's Histogram observes one value at a time; the engine's inter-token latencies come per
step as (latency, number of tokens), and observing each token separately would be per-token work on the
engine's hot path. The exposition is the standard one (`_bucket`, `_sum`, `_count`).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class WeightedHistogram(Collector):
    """One unlabelled histogram; register it with a CollectorRegistry."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(bounds)
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        """Record `count` observations of `value` (a bucket holds the values <= its bound)."""
        index = bisect_left(self._bounds, value)
        with self._lock:
            self._counts[index] += count
            self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)
