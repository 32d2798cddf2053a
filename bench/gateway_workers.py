"""Gateway workers: SSE throughput of `conduit-gateway --workers 1` and `--workers N`, side by side, one run.

    .venv/bin/python bench/gateway_workers.py [--workers 2] [--streams 256] [--max-tokens 64]
        [--seconds 5] [--rounds 3] [--fakes 2] [--clients 2] [--gateway-cpus 0,1] [--other-cpus 2-15]

Instant fake engines (several processes, round-robined, so the engine side is not what limits) feed
both gateways, which run at once; rounds alternate between them so drift on a shared machine hits
both. Client processes keep --streams completions streaming for --seconds, each slot sending the next
request when its stream ends; the client is a bare asyncio HTTP/1.1 loop that counts `data: ` frames
without parsing JSON, so an event costs it far less than it costs the gateway (its processes' CPU is
printed beside the gateway's to show it). Prints, per worker count, SSE events/s (best round), the
gateway's CPU-seconds per second (its processes, from /proc) and events per gateway CPU-second, then the
throughput ratio N / 1 (goal >= 1.7 with 2 workers on 2 cores when nothing else limits).

--gateway-cpus pins the gateways' processes to those CPUs and everything else to --other-cpus: on a
machine with spare cores, the ratio is then what N workers buy on that many cores. Without it all
processes share the machine, and the ratio also reflects the clients' and fakes' share of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

from proc_stats import cpu_seconds  # noqa: E402

from tests.support.proc_tree import descendants  # noqa: E402
from tests.support.processes import ManagedProcess, free_port, start_gateway  # noqa: E402


def parse_cpus(text: str | None) -> set[int] | None:
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


async def _slot(port: int, request: bytes, deadline: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0]
            if b" 200 " not in status:
                raise RuntimeError(f"gateway answered {status!r}")
            tail = b""
            while True:
                data = await reader.read(65536)
                if not data:
                    raise RuntimeError("the gateway closed the connection mid-stream")
                window = tail + data
                counts[0] += window.count(b"data: ") - tail.count(b"data: ")
                tail = window[-32:]
                if tail.endswith(b"\r\n0\r\n\r\n") and b"[DONE]" in window[-64:]:
                    break  # the last chunk of a chunked response whose last event is [DONE]
            counts[0] -= 1  # [DONE] is not an event
            counts[1] += 1
    finally:
        writer.close()


def _client(port: int, body: bytes, streams: int, seconds: float, cpus: set[int] | None, out) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts = [0, 0]

    async def run() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_slot(port, request, deadline, counts) for _ in range(streams)))

    asyncio.run(run())
    out.put(tuple(counts))


@dataclass
class Round:
    events: int
    requests: int
    seconds: float
    gateway_cpu_s: float
    client_cpu_s: float

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds


def measure(
    gateway: ManagedProcess, args: argparse.Namespace, seconds: float, cpus: set[int] | None
) -> Round:
    body = json.dumps(
        {"model": "fake-model", "prompt": "x", "max_tokens": args.max_tokens, "stream": True}
    ).encode()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    per_client = [
        args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)
    ]
    clients = [
        context.Process(target=_client, args=(gateway.port, body, n, seconds, cpus, out)) for n in per_client
    ]
    gateway_pids = [gateway.process.pid, *descendants(gateway.process.pid)]
    before = cpu_seconds(*gateway_pids)
    started = time.perf_counter()
    for client in clients:
        client.start()
    results = [out.get(timeout=seconds + 120) for _ in clients]
    elapsed = time.perf_counter() - started
    client_cpu = cpu_seconds(*[client.pid for client in clients if client.pid is not None])
    gateway_cpu = cpu_seconds(*gateway_pids) - before
    for client in clients:
        client.join()
    return Round(
        events=sum(r[0] for r in results),
        requests=sum(r[1] for r in results),
        seconds=elapsed,
        gateway_cpu_s=gateway_cpu,
        client_cpu_s=client_cpu,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64, help="the fake engine caps at 64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fakes", type=int, default=2, help="fake engine processes behind each gateway")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument(
        "--generate-stream",
        choices=["on", "off"],
        default="on",
        help="the fakes serve GenerateStream, so the gateways multiplex (off: a Generate call per stream)",
    )
    parser.add_argument("--gateway-cpus", help="CPUs of the gateways' processes, e.g. 0,1")
    parser.add_argument("--other-cpus", help="CPUs of the fakes and clients, e.g. 2-15")
    args = parser.parse_args()
    gateway_cpus, other_cpus = parse_cpus(args.gateway_cpus), parse_cpus(args.other_cpus)
    print(
        f"{args.streams} streams x {args.max_tokens} tokens, {args.fakes} fake engines, {args.clients} "
        f"client processes, {args.seconds:.0f} s a round, {args.rounds} rounds; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        + (f"; gateways on CPUs {sorted(gateway_cpus)}" if gateway_cpus else "")
    )
    with ExitStack() as stack:
        if other_cpus:
            os.sched_setaffinity(0, other_cpus)
        fakes = []
        for _ in range(args.fakes):
            port = free_port()
            fake_args = [sys.executable, "-m", "tests.support.fake_engine", "--port", str(port)]
            fake_args += ["--generate-stream", args.generate_stream]
            fakes.append(stack.enter_context(ManagedProcess("fake-engine", fake_args, port)))
        time.sleep(2.0)  # the fakes' servers start; the gateways wait for their health anyway
        engines = [fake.address for fake in fakes]
        gateways: dict[int, ManagedProcess] = {}
        for workers in (1, args.workers):
            if gateway_cpus:
                os.sched_setaffinity(0, gateway_cpus)  # the gateway's processes inherit it
            gateways[workers] = stack.enter_context(
                start_gateway(engines, "--workers", str(workers), "--log-level", "warning")
            )
            if other_cpus:
                os.sched_setaffinity(0, other_cpus)
        for gateway in gateways.values():
            measure(gateway, args, 1.0, other_cpus)  # warm-up
        rounds: dict[int, list[Round]] = {workers: [] for workers in gateways}
        for _ in range(args.rounds):
            for workers, gateway in gateways.items():
                rounds[workers].append(measure(gateway, args, args.seconds, other_cpus))
    best = {workers: max(results, key=lambda r: r.events_per_s) for workers, results in rounds.items()}
    for workers, result in best.items():
        per_cpu_s = result.events / max(result.gateway_cpu_s, 1e-9)
        print(
            f"  --workers {workers}: {result.events_per_s:9.0f} SSE events/s  "
            f"({result.requests / result.seconds:6.0f} streams/s)  "
            f"gateway {result.gateway_cpu_s / result.seconds:4.2f} CPU-s/s, "
            f"{per_cpu_s:7.0f} events per gateway CPU-s;  "
            f"clients {result.client_cpu_s / result.seconds:4.2f} CPU-s/s"
        )
        print("      rounds: " + ", ".join(f"{r.events_per_s:.0f}" for r in rounds[workers]))
    ratio = best[args.workers].events_per_s / best[1].events_per_s
    print(f"  throughput ratio --workers {args.workers} / --workers 1: {ratio:.2f}")


if __name__ == "__main__":
    main()
