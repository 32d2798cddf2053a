"""Text reports: one run's figures, and the peer ratio table of bench/peers.py (pure formatting)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.loadgen.results import RunResult

DASH = "–"
_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def _num(value: float | int | None, digits: int = 1) -> str:
    if value is None or value != value:  # None or NaN
        return DASH
    return f"{value:,.{digits}f}"


def format_run(result: RunResult) -> str:
    meta, s = result.meta, result.summary
    lines = [
        f"{meta['label']}  {meta['load']}  /{meta['endpoint']}  {s['requests']} requests "
        f"({s['failed']} failed) in {s['duration_s']:.1f} s",
        f"  throughput: {s['request_throughput']:.2f} req/s, output {s['output_tok_s']:,.1f} tok/s, "
        f"total {s['total_tok_s']:,.1f} tok/s  (output tokens from "
        f"{'server usage' if s['usage_reported'] else 'streamed chunks'})",
        f"  {'latency ms':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, key in _LATENCIES:
        stats = s[key]
        row = "".join(f"{_num(stats[k], 2):>10}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"  {name:<12}{row}")
    goodput = s.get("goodput")
    if goodput:
        slo = ", ".join(
            f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in goodput["slo"].items() if v
        )
        lines.append(
            f"  goodput: {goodput['request_throughput']:.2f} req/s "
            f"({100 * goodput['good_fraction']:.0f}% of requests meet {slo})"
        )
    for error in s["errors"]:
        lines.append(f"  error: {error}")
    return "\n".join(lines)


@dataclass(frozen=True)
class TableRow:
    """One row of the peer table: a model at a concurrency, output tok/s per server (None: not run)."""

    model: str
    concurrency: int
    tok_s: Mapping[str, float | None]


def ratio(numerator: float | None, denominator: float | None) -> str:
    if not numerator or not denominator:
        return DASH
    return f"{numerator / denominator:.2f}"


def format_ratio_table(rows: Sequence[TableRow], peers: Sequence[str], base: str = "conduit") -> str:
    """A Markdown table: output tok/s of every server, then `base` divided by each other server."""
    others = [p for p in peers if p != base]
    header = ["model, concurrency", *peers, *(f"{base} ÷ {p}" for p in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row.model}, c={row.concurrency}"]
        cells += [_num(row.tok_s.get(p), 0) for p in peers]
        cells += [ratio(row.tok_s.get(base), row.tok_s.get(p)) for p in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
