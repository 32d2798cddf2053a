"""Histogram buckets the engine and the gateway share, so their latencies line up bucket for bucket."""

from __future__ import annotations

# Time between consecutive tokens of a choice: sub-millisecond (small models on a GPU) to seconds.
TOKEN_GAP_SECONDS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075),
    *(0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0),
)
