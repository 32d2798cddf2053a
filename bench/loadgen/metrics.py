"""Summary statistics of a run: throughput, latency percentiles, goodput under SLOs (pure functions)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from bench.loadgen.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(seconds: Iterable[float]) -> dict[str, float | int]:
    """count, mean and p50/p90/p99 of latencies given in seconds, reported in milliseconds."""
    values = [1000.0 * s for s in seconds]
    stats: dict[str, float | int] = {
        "count": len(values),
        "mean": sum(values) / len(values) if values else float("nan"),
    }
    for q in PERCENTILES:
        stats[f"p{q}"] = percentile(values, q)
    return stats


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; a request is good when it meets every one that is set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft is None or 1000 * record.ttft > self.ttft_ms):
            return False
        # A request with one output token has no TPOT: that objective does not apply to it.
        tpot = record.tpot
        if self.tpot_ms is not None and tpot is not None and 1000 * tpot > self.tpot_ms:
            return False
        return self.e2e_ms is None or (record.e2e is not None and 1000 * record.e2e <= self.e2e_ms)

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> dict:
    """The figures a run reports; token rates count prompt tokens from usage when the server gave them."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(
        (r.prompt_tokens if r.prompt_tokens is not None else r.planned_prompt_tokens or 0) for r in done
    )
    duration = max(duration_s, 1e-9)
    summary = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "usage_reported": all(r.usage_reported for r in done) if done else False,
        "request_throughput": len(done) / duration,
        "output_tok_s": output_tokens / duration,
        "total_tok_s": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": latency_stats(r.ttft for r in done if r.ttft is not None),
        "tpot_ms": latency_stats(t for r in done if (t := r.tpot) is not None),
        "itl_ms": latency_stats(gap for r in done for gap in r.itl),
        "e2e_ms": latency_stats(r.e2e for r in done if r.e2e is not None),
        "goodput": None,
    }
    if slo is not None and slo.is_set:
        good = sum(1 for r in records if slo.met_by(r))
        summary["goodput"] = {
            "slo": slo.to_dict(),
            "good_requests": good,
            "good_fraction": good / len(records) if records else float("nan"),
            "request_throughput": good / duration,
        }
    return summary
