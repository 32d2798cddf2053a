"""Tenant isolation benchmark: does one key's oversized prompts hurt another key's short requests?

    .venv/bin/python bench/tenant_isolation.py [--prompt-bytes 8000000] [--attackers 4] [--requests 50]

A real engine (stories260K, a 512-token context) behind the real gateway, with two API keys. The victim
key sends short completions (a 4-token prompt, 4 tokens out) on a fixed schedule, one every 100 ms
whatever the answers (so a stall shows in every request due during it): first at idle, then while
the attacker key has `attackers` completions of `prompt-bytes` bytes of text in flight at once (each
attacker sends its next prompt as soon as the last is answered, until the victim is done and every
attacker has been answered at least once). A prompt that size cannot fit the context: the point is what
refusing it costs.

Prints the victim's latency mean / p50 / p90 / max at idle and under attack and their ratios (goal:
within 2×) and its requests not answered 200 (each gives up after 120 s), how the attacker's prompts
were answered (status, seconds), and the engine's resident memory before the attack, its peak during it
(sampled every 10 ms) and after it (goal: growth under 100 MB).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import httpx  # noqa: E402

from bench.common import stories_path  # noqa: E402
from tests.support.processes import start_engine, start_gateway  # noqa: E402

VICTIM_KEY, ATTACKER_KEY = "sk-victim-0001", "sk-attacker-0002"
VICTIM_BODY = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
VICTIM_TIMEOUT_S = 120.0
VICTIM_INTERVAL_S = 0.1
FAILURES: Counter[str] = Counter()  # the victim's answers other than 200, by status
ATTACK_LIMIT_S = 90.0  # no victim request is scheduled after this, even if an attacker is still unanswered


def rss_bytes(pid: int) -> int:
    """The resident size of `pid` (0 once it has exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class RssSampler(threading.Thread):
    """The highest resident size of `pid` seen while running (every 10 ms)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, rss_bytes(pid), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, rss_bytes(self.pid))


def victim_latencies(
    url: str, model: str, count: int, keep_going: threading.Event | None = None, deadline: float = 0.0
) -> list[float]:
    """Latencies of short completions sent on a fixed schedule (one every VICTIM_INTERVAL_S, whatever the
    answers: a stall delays every request due meanwhile), `count` of them and more while `keep_going` is
    set, none scheduled after `deadline` (a perf_counter time). Each counts from its scheduled time; one
    over VICTIM_TIMEOUT_S counts as that."""
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)

    def one(client: httpx.Client, due: float) -> float:
        try:
            status = client.post("/v1/completions", json={"model": model, **VICTIM_BODY}).status_code
        except httpx.TimeoutException:
            status = "timeout"
        if status != 200:
            FAILURES[str(status)] += 1
        return time.perf_counter() - due

    with (
        httpx.Client(base_url=url, headers=headers, timeout=VICTIM_TIMEOUT_S, limits=limits) as client,
        # A thread per request due (at most ATTACK_LIMIT_S / VICTIM_INTERVAL_S): none waits for a free one.
        concurrent.futures.ThreadPoolExecutor(int(ATTACK_LIMIT_S / VICTIM_INTERVAL_S) + 8) as pool,
    ):
        calls: list[concurrent.futures.Future[float]] = []
        start = time.perf_counter()
        while len(calls) < count or (keep_going is not None and keep_going.is_set()):
            due = start + len(calls) * VICTIM_INTERVAL_S
            if deadline and due > deadline and len(calls) >= count:
                break
            time.sleep(max(0.0, due - time.perf_counter()))
            calls.append(pool.submit(one, client, due))
        return [call.result() for call in calls]


def attacker(url: str, model: str, size: int, stop: Any, answered: Any, results: Any) -> None:
    """One attacker process (its own interpreter: the victim's client shares no GIL with it)."""
    headers = {"Authorization": f"Bearer {ATTACKER_KEY}", "content-type": "application/json"}
    body = json.dumps({"model": model, "prompt": "a" * size, "max_tokens": 4}).encode()
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        while True:
            started = time.perf_counter()
            try:
                status: int | str = client.post("/v1/completions", content=body).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            results.put((status, time.perf_counter() - started))
            answered.set()
            if stop.is_set():
                return


def p90(times: list[float]) -> float:
    return sorted(times)[int(0.9 * (len(times) - 1))]


def describe(times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return (
        f"mean {statistics.mean(ms):.1f} ms, p50 {statistics.median(ms):.1f} ms, p90 {p90(ms):.1f} ms, "
        f"max {max(ms):.1f} ms (n={len(ms)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-bytes", type=int, default=8_000_000)
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=50, help="victim requests per phase (at least)")
    args = parser.parse_args()

    keys = Path(tempfile.mkdtemp(prefix="tenant-bench-")) / "keys.json"
    keys.write_text(
        json.dumps([{"name": "victim", "key": VICTIM_KEY}, {"name": "attacker", "key": ATTACKER_KEY}])
    )
    engine = start_engine(stories_path())
    gateway = None
    try:
        gateway = start_gateway(engine.address, "--api-keys-file", str(keys))
        model = httpx.get(
            f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {VICTIM_KEY}"}
        ).json()
        model = model["data"][0]["id"]
        victim_latencies(gateway.url, model, 5)  # warm the path
        idle = victim_latencies(gateway.url, model, args.requests)
        FAILURES.clear()

        pid = engine.process.pid
        before = rss_bytes(pid)
        sampler = RssSampler(pid)
        sampler.start()
        mp = multiprocessing.get_context("spawn")
        stop, results = mp.Event(), mp.Queue()
        answered = [mp.Event() for _ in range(args.attackers)]
        attackers = [
            mp.Process(target=attacker, args=(gateway.url, model, args.prompt_bytes, stop, done, results))
            for done in answered
        ]
        attack_started = time.perf_counter()
        for process in attackers:
            process.start()
        time.sleep(1.0)  # the attackers have started and their bodies are on their way
        pending = threading.Event()
        pending.set()
        watcher = threading.Thread(
            target=lambda: ([done.wait() for done in answered], pending.clear()), daemon=True
        )
        watcher.start()
        deadline = attack_started + ATTACK_LIMIT_S
        attacked = victim_latencies(gateway.url, model, args.requests, pending, deadline)
        stop.set()
        for process in attackers:
            process.join(timeout=max(1.0, deadline - time.perf_counter()))
            if process.is_alive():
                process.terminate()
                results.put(("unanswered", time.perf_counter() - attack_started))
        log = []
        while True:
            try:
                log.append(results.get(timeout=0.5))
            except queue.Empty:
                break
        attack_s = time.perf_counter() - attack_started
        time.sleep(1.0)
        sampler.stop.set()
        sampler.join()
        after = rss_bytes(pid)
    finally:
        if gateway is not None:
            gateway.stop()
        engine.stop()

    failed = dict(FAILURES)
    ratio = statistics.median(attacked) / statistics.median(idle)
    tail = p90(attacked) / p90(idle)
    mean = statistics.mean(attacked) / statistics.mean(idle)
    mib = 1024 * 1024
    outcomes = Counter(status for status, _ in log)
    refuse = [seconds for _, seconds in log] or [float("nan")]
    print(f"victim at idle:        {describe(idle)}")
    print(f"victim under attack:   {describe(attacked)}; not answered 200: {failed or 'none'}")
    print(f"ratio under attack:    mean {mean:.2f}x, p50 {ratio:.2f}x, p90 {tail:.2f}x (goal: within 2x)")
    print(
        f"attacker:              {len(log)} prompts of {args.prompt_bytes} bytes ({args.attackers} at once, "
        f"{attack_s:.1f} s): {dict(outcomes)}, answered in p50 {statistics.median(refuse):.2f} s, "
        f"max {max(refuse):.2f} s"
    )
    print(
        f"engine RSS:            before {before / mib:.0f} MiB, peak {sampler.peak / mib:.0f} MiB, "
        f"after {after / mib:.0f} MiB; growth peak {(sampler.peak - before) / mib:.0f} MiB, "
        f"kept {(after - before) / mib:.0f} MiB (goal: < 100 MB)"
    )


if __name__ == "__main__":
    main()
