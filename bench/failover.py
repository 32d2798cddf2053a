"""Failover benchmark: what a migrated stream costs when an engine is SIGKILLed under load.

    .venv/bin/python bench/failover.py [--model stories|20m|PATH] [--streams 48] [--max-tokens 400]
                                       [--kill-after 0.3] [--max-num-seqs 32]

Two runs side by side, each on three fresh engines behind the real gateway process (round_robin): the
same `streams` concurrent greedy completions streams, once unbroken (the baseline) and once with engine 0
SIGKILLed when it has generated `kill-after` of its share of the tokens. The gateway migrates the streams that
were running there (its log names them).

Prints: the inter-token latency (ITL: the gap between reads that bring tokens) p50 / p99 of the
baseline; for the migrated streams, the gap at the migration (from their last token before the kill to
their first from the new engine) p50 / p99 and as a multiple of the baseline ITL p50; the throughput
(tokens/s) before the kill, its lowest 0.25 s bin after it, and the rest of the run (two engines left)
against the baseline's; and failed requests (0 is the goal). Greedy outputs of both runs are compared as
well (they must be equal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import httpx  # noqa: E402

from bench.common import random_llama_20m, stories_path  # noqa: E402
from tests.support.engine_fleet import EngineFleet  # noqa: E402
from tests.support.processes import start_gateway  # noqa: E402

MODEL_NAME = "bench"
BIN_S = 0.25
SAME_READ_S = 0.0005  # tokens closer than this arrived together
# The gateway's migration line; it names the stream by the x-request-id this bench sent (the gateway's
# own request id is another).
_MOVED = re.compile(r"request \S+: prompt \d+ choices \[[^\]]*\] moved from .* client_request_id=(\S+)")


@dataclass
class Stream:
    """One stream's token arrival times and text."""

    request_id: str
    times: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    error: str | None = None


async def _stream(client: httpx.AsyncClient, index: int, max_tokens: int, out: Stream) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": f"Once upon a time, number {index},",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"x-request-id": out.request_id}
        ) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"].get("code")
                    continue
                for choice in event.get("choices", ()):
                    if choice.get("text"):
                        out.times.append(time.perf_counter())
                        out.text += choice["text"]
                        out.tokens += 1
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__


async def _load(url: str, streams: list[Stream], max_tokens: int, kill: asyncio.Event | None) -> float:
    limits = httpx.Limits(max_connections=len(streams) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(_stream(client, i, max_tokens, s)) for i, s in enumerate(streams)]
        if kill is not None:
            await kill.wait()
        await asyncio.gather(*tasks)
        return started


def _run(
    model: Path, args: argparse.Namespace, kill: bool
) -> tuple[list[Stream], float, float | None, set[str]]:
    """One run on a fresh fleet: the streams, when they started, when engine 0 was killed, who moved."""
    engine_args = ("--served-model-name", MODEL_NAME, "--max-num-seqs", str(args.max_num_seqs))
    with EngineFleet(model, 3, engine_args) as fleet:
        with start_gateway(fleet.addresses, "--routing", "round_robin", "--retries", "2") as gateway:
            streams = [Stream(f"failover-{'kill' if kill else 'base'}-{i}") for i in range(args.streams)]
            killed_at: list[float] = []

            async def main() -> float:
                event = asyncio.Event()
                load = asyncio.create_task(_load(gateway.url, streams, args.max_tokens, event))
                if kill:
                    # Engine 0's own share (round robin: a third), as it reports it: engines run unevenly.
                    target = args.kill_after * args.streams * args.max_tokens / 3
                    while (await asyncio.to_thread(fleet.load, 0)).generated_tokens < target:
                        await asyncio.sleep(0.01)
                    fleet.kill(0)
                    killed_at.append(time.perf_counter())
                event.set()
                return await load

            started = asyncio.run(main())
            moved = set(_MOVED.findall(gateway.output_tail(10_000_000)))
    return streams, started, (killed_at[0] if killed_at else None), moved


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _gaps(stream: Stream) -> list[float]:
    """Gaps between the reads that brought tokens (tokens of one read, e.g. a decode burst, are one)."""
    gaps = [b - a for a, b in zip(stream.times, stream.times[1:], strict=False)]
    return [gap for gap in gaps if gap >= SAME_READ_S]


def _bins(streams: list[Stream], start: float, end: float) -> list[float]:
    """Throughput of each whole BIN_S window from `start` to `end`."""
    bins = []
    t = start
    while t + BIN_S <= end:
        bins.append(_throughput(streams, t, t + BIN_S))
        t += BIN_S
    return bins


def _throughput(streams: list[Stream], start: float, end: float) -> float:
    tokens = sum(1 for s in streams for t in s.times if start <= t < end)
    return tokens / (end - start) if end > start else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stories", help="stories (stories260K), 20m, or a folder")
    parser.add_argument("--streams", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument(
        "--kill-after", type=float, default=0.3, help="share of engine 0's tokens before the kill"
    )
    # Room for the moved streams on the two engines left: the gap measures the move, not a queue.
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()
    model = {"stories": stories_path, "20m": random_llama_20m}.get(args.model, lambda: Path(args.model))()

    base, base_start, _, _ = _run(model, args, kill=False)
    runs, start, killed_at, moved = _run(model, args, kill=True)
    assert killed_at is not None

    base_itl = [gap for s in base for gap in _gaps(s)]
    itl_p50, itl_p99 = _percentile(base_itl, 0.5), _percentile(base_itl, 0.99)
    migration_gaps = []
    for stream in runs:
        if stream.request_id not in moved:
            continue
        before = [t for t in stream.times if t <= killed_at]
        after = [t for t in stream.times if t > killed_at]
        if before and after:
            migration_gaps.append(after[0] - before[-1])
    end = max(t for s in runs for t in s.times)
    base_end = max(t for s in base for t in s.times)
    bins = _bins(runs, killed_at, end)
    # The same span of the unbroken run: delivery is bursty on a small machine, so its lowest bin is the
    # yardstick for the dip the kill adds.
    base_bins = _bins(base, base_start + (killed_at - start), base_end)
    pre = _throughput(runs, start + 0.5, killed_at)
    base_tps = _throughput(base, base_start + 0.5, base_end)
    rest = _throughput(runs, killed_at + 2.0, end)
    failed = [s for s in runs if s.error is not None]
    equal = sum(1 for a, b in zip(base, runs, strict=True) if a.text == b.text)

    print(f"failover: {args.streams} streams × {args.max_tokens} tokens, model {args.model}, 3 engines")
    print(f"  baseline ITL p50 {itl_p50 * 1e3:.1f} ms, p99 {itl_p99 * 1e3:.1f} ms; {base_tps:.0f} tok/s")
    if migration_gaps:
        g50, g99 = _percentile(migration_gaps, 0.5), _percentile(migration_gaps, 0.99)
        print(f"  migrated streams {len(migration_gaps)} (gateway log: {len(moved)}): gap at the migration")
        print(
            f"    p50 {g50 * 1e3:.1f} ms ({g50 / itl_p50:.1f}× ITL p50), "
            f"p99 {g99 * 1e3:.1f} ms ({g99 / itl_p50:.1f}×)"
        )
    else:
        print(f"  no migrated stream measured (gateway log names {len(moved)})")
    low = min(bins, default=0.0)
    base_low = min(base_bins, default=0.0)
    print(
        f"  throughput before the kill {pre:.0f} tok/s; "
        f"lowest {BIN_S} s bin after it {low:.0f} ({low / pre:.2f}×); "
        f"the unbroken run's lowest over the same span {base_low:.0f}"
    )
    print(
        f"  from 2 s after the kill {rest:.0f} tok/s ({rest / base_tps:.2f}× the baseline's {base_tps:.0f})"
    )
    print(f"  failed requests {len(failed)}; outputs equal to the baseline run {equal}/{len(runs)}")
    print(f"  total: baseline {base_end - base_start:.1f} s, with the kill {end - start:.1f} s")


if __name__ == "__main__":
    main()
