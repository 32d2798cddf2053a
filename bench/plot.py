"""Draw serving runs side by side into one PNG: latency CDFs (TTFT, TPOT, ITL, E2E) and output
throughput against the load (request rate for Poisson runs, concurrency for closed-loop runs).

    .venv/bin/python bench/plot.py results.jsonl [more.jsonl ...] -o serving.png

Reads the JSON Lines that bench/serving.py --out and bench/peers.py write. Needs matplotlib
(`make bench-setup`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.loadgen.results import RunResult, read_results  # noqa: E402

_CDFS = (
    ("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
    ("TPOT", lambda r: [r.tpot] if r.tpot is not None else []),
    ("ITL", lambda r: r.itl),
    ("E2E latency", lambda r: [r.e2e] if r.e2e is not None else []),
)


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    ordered = sorted(values_ms)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)


def _throughput(ax, results: Sequence[RunResult], mode: str) -> bool:
    """Output tok/s against the offered load of `mode`, one line per server label."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for result in results:
        if result.meta["mode"] != mode:
            continue
        value = result.meta["value"]
        x = math.inf if value == "inf" else float(value)
        series[result.meta["label"]].append((x, result.summary["output_tok_s"]))
    if not series:
        return False
    xs = [x for points in series.values() for x, _ in points]
    finite = [x for x in xs if math.isfinite(x)]
    inf_at = 2 * max(finite) if finite else 1.0  # where a rate of 'inf' (all at once) is drawn
    for label, points in series.items():
        points = sorted((inf_at if math.isinf(x) else x, y) for x, y in points)
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    if mode == "concurrency":
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(xs)), labels=[f"{x:g}" for x in sorted(set(xs))])
    else:
        note = f"; 'inf' drawn at {inf_at:g}" if len(finite) < len(xs) else ""
        ax.set_xlabel(f"request rate (req/s{note})")
    ax.set_yscale("log")  # runs of models of very different sizes share the panel
    ax.set_ylabel("output tok/s (log scale)")
    ax.set_title(f"throughput against {'request rate' if mode == 'rate' else 'concurrency'}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return True


def plot_runs(results: Sequence[RunResult], path: Path) -> None:
    """One PNG: a CDF panel per latency (every run a line), then the throughput panels that apply."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    cdf_axes = [axes[0][0], axes[0][1], axes[0][2], axes[1][0]]
    for ax, (name, pick) in zip(cdf_axes, _CDFS, strict=True):
        for result in results:
            values = [1000 * v for r in result.records if r.ok for v in pick(r)]
            _cdf(ax, values, f"{result.meta['label']} {result.meta['load']}")
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax, mode in ((axes[1][1], "rate"), (axes[1][2], "concurrency")):
        if not _throughput(ax, results, mode):
            ax.set_axis_off()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="JSON Lines files of runs")
    parser.add_argument("-o", "--output", type=Path, default=Path("serving.png"))
    args = parser.parse_args()
    results = [run for path in args.results for run in read_results(path)]
    if not results:
        raise SystemExit("no runs in the given files")
    plot_runs(results, args.output)
    print(f"{len(results)} runs drawn into {args.output}")


if __name__ == "__main__":
    main()
