"""A stream's inter-token gaps, counted here and added to the gateway's histogram a batch at a time.

`Histogram.observe` takes a lock for the sum and one for the bucket of every value; per token, for
every stream, that was a visible share of what a token costs the gateway. A `TokenGaps` counts a
stream's gaps per bucket itself and adds the counts to the histogram every FLUSH_EVERY gaps and when
the stream closes, so a scrape sees a stream's gaps at most FLUSH_EVERY tokens late.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Gaps counted before they go into the histogram (about a second of a stream at 64 tokens/s).
FLUSH_EVERY = 64


class TokenGaps:
    """Counts for one labelled histogram child; `add` per gap, `flush` at the end."""

    __slots__ = ("_child", "_bounds", "_counts", "_sum", "_pending")

    def __init__(self, child: Any) -> None:
        self._child = child
        # prometheus_client's histogram child: its upper bounds (the last +Inf), a value per bucket and
        # one for the sum. Without them (another version), each gap is observed as it comes.
        bounds = getattr(child, "_upper_bounds", None)
        usable = bounds is not None and hasattr(child, "_buckets") and hasattr(child, "_sum")
        self._bounds: list[float] | None = list(bounds) if usable else None
        self._counts = [0] * len(self._bounds) if self._bounds is not None else []
        self._sum = 0.0
        self._pending = 0

    def add(self, gap: float) -> None:
        if self._bounds is None:
            self._child.observe(gap)
            return
        self._counts[bisect_left(self._bounds, gap)] += 1  # the first bound >= gap, as observe picks
        self._sum += gap
        self._pending += 1
        if self._pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        child = self._child
        child._sum.inc(self._sum)
        for index, count in enumerate(self._counts):
            if count:
                child._buckets[index].inc(count)
                self._counts[index] = 0
        self._sum = 0.0
        self._pending = 0
