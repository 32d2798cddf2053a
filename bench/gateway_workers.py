"""Gateway workers: SSE throughput of `conduit-gateway --workers 1` and `--workers N`, side by side, one run.

    .venv/bin/python bench/gateway_workers.py [--workers 2] [--streams 256] [--max-tokens 64]
        [--step-ms 6] [--seconds 5] [--rounds 3] [--fakes 1] [--client python|wrk] [--clients 2]
        [--generate-stream on|off] [--gateway-cpus 0,1] [--other-cpus 2-15]

The fake engine of bench/stream_fake_engine.py (pre-serialised messages, one GenerateStream batch per
tick for every stream, so a token costs it about a microsecond: the engine side is not what limits)
feeds both gateways, which run at once; rounds alternate between them so drift on a shared machine hits
both. Each stream gets a token every --step-ms (the offered load: streams / step tokens a second).
Clients keep --streams completions streaming for --seconds, each slot sending the next request when its
stream ends:
- python (default): --clients processes, each a bare asyncio HTTP/1.1 loop that reads what has arrived
  and counts `data: ` frames and the fake's tokens (its text, "§") without parsing JSON;
- wrk: one `wrk` thread (C, epoll; `make bench-setup` installs Debian's package), which costs less
  still; it counts whole streams, so tokens are its completed requests x --max-tokens (any non-200
  answer is an error).
The clients' CPU-seconds are printed beside the gateway's to show what they take of the machine.
Prints, per worker count, tokens/s and SSE events/s delivered (best round), the gateway's CPU-seconds per
second (its processes, from /proc) and tokens per gateway CPU-second, then the throughput ratio N / 1
(goal >= 1.7 with 2 workers on 2 cores when nothing else limits).

--gateway-cpus pins the gateways' processes to those CPUs and everything else to --other-cpus: on a
machine with spare cores, the ratio is then what N workers buy on that many cores. Without it all
processes share the machine, and the ratio also reflects the clients' and the fake's share of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
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


TOKEN = "§".encode()  # the fake engine's text: one per token


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
                counts[1] += window.count(TOKEN) - tail.count(TOKEN)
                tail = window[-32:]
                if tail.endswith(b"\r\n0\r\n\r\n") and b"[DONE]" in window[-64:]:
                    break  # the last chunk of a chunked response whose last event is [DONE]
            counts[0] -= 1  # [DONE] is not an event
            counts[2] += 1
    finally:
        writer.close()


def _client(port: int, body: bytes, streams: int, seconds: float, cpus: set[int] | None, out) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts = [0, 0, 0]  # events, tokens, streams

    async def run() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_slot(port, request, deadline, counts) for _ in range(streams)))

    asyncio.run(run())
    out.put(tuple(counts))


# wrk's script: the request, and a summary line of JSON at the end.
_WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests": %%d, "errors": %%d}\\n', summary.requests,
    e.status + e.connect + e.read + e.write + e.timeout))
end
"""


@dataclass
class Round:
    events: int | None  # None: the client does not count them (wrk)
    tokens: int
    requests: int
    seconds: float
    gateway_cpu_s: float
    client_cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _body(args: argparse.Namespace) -> bytes:
    return json.dumps(
        {
            "model": "fake-model",
            "prompt": "x",
            "max_tokens": args.max_tokens,
            "stream": True,
            "seed": args.step_ms,  # the fake's tick, ms
        }
    ).encode()


def measure(
    gateway: ManagedProcess, args: argparse.Namespace, seconds: float, cpus: set[int] | None
) -> Round:
    gateway_pids = [gateway.process.pid, *descendants(gateway.process.pid)]
    before = cpu_seconds(*gateway_pids)
    if args.client == "wrk":
        return _measure_wrk(gateway, args, seconds, cpus, gateway_pids, before)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    per_client = [
        args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)
    ]
    clients = [
        context.Process(target=_client, args=(gateway.port, _body(args), n, seconds, cpus, out))
        for n in per_client
    ]
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
        tokens=sum(r[1] for r in results),
        requests=sum(r[2] for r in results),
        seconds=elapsed,
        gateway_cpu_s=gateway_cpu,
        client_cpu_s=client_cpu,
    )


def _measure_wrk(
    gateway: ManagedProcess,
    args: argparse.Namespace,
    seconds: float,
    cpus: set[int] | None,
    gateway_pids: list[int],
    before: float,
) -> Round:
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(_WRK_SCRIPT % json.dumps(_body(args).decode()))
        script.flush()
        command = [
            "wrk",
            "-t1",
            f"-c{args.streams}",
            f"-d{seconds:g}s",
            "-s",
            script.name,
            f"{gateway.url}/v1/completions",
        ]
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(
            command, capture_output=True, text=True, check=True, preexec_fn=_pin(cpus), timeout=seconds + 120
        )
        elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    if summary["errors"]:
        raise RuntimeError(f"wrk saw {summary['errors']} errors:\n{done.stdout}")
    return Round(
        events=None,
        tokens=summary["requests"] * args.max_tokens,
        requests=summary["requests"],
        seconds=elapsed,
        gateway_cpu_s=cpu_seconds(*gateway_pids) - before,
        client_cpu_s=after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime,
    )


def _pin(cpus: set[int] | None):
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=int, default=6, help="a token per stream every STEP ms")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fakes", type=int, default=1, help="fake engine processes behind each gateway")
    parser.add_argument("--client", choices=["python", "wrk"], default="python")
    parser.add_argument("--clients", type=int, default=2, help="client processes (--client python)")
    parser.add_argument(
        "--generate-stream",
        choices=["on", "off"],
        default="on",
        help="the gateways multiplex on GenerateStream (off: --engine-multiplex false, a Generate call each)",
    )
    parser.add_argument("--gateway-cpus", help="CPUs of the gateways' processes, e.g. 0,1")
    parser.add_argument("--other-cpus", help="CPUs of the fakes and clients, e.g. 2-15")
    args = parser.parse_args()
    if args.client == "wrk" and shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (make bench-setup installs it)")
    gateway_cpus, other_cpus = parse_cpus(args.gateway_cpus), parse_cpus(args.other_cpus)
    clients = f"{args.clients} client processes" if args.client == "python" else "wrk"
    print(
        f"{args.streams} streams x {args.max_tokens} tokens, a token every {args.step_ms} ms a stream, "
        f"{args.fakes} fake engines, {clients}, {args.seconds:.0f} s a round, {args.rounds} rounds; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        + (f"; gateways on CPUs {sorted(gateway_cpus)}" if gateway_cpus else "")
    )
    with ExitStack() as stack:
        if other_cpus:
            os.sched_setaffinity(0, other_cpus)
        fakes = []
        for _ in range(args.fakes):
            port = free_port()
            fake_args = [sys.executable, str(REPO / "bench" / "stream_fake_engine.py"), "--port", str(port)]
            fakes.append(stack.enter_context(ManagedProcess("fake-engine", fake_args, port)))
        time.sleep(2.0)  # the fakes' servers start; the gateways wait for their health anyway
        engines = [fake.address for fake in fakes]
        gateways: dict[int, ManagedProcess] = {}
        for workers in (1, args.workers):
            if gateway_cpus:
                os.sched_setaffinity(0, gateway_cpus)  # the gateway's processes inherit it
            gateways[workers] = stack.enter_context(
                start_gateway(
                    engines,
                    *("--workers", str(workers), "--log-level", "warning"),
                    *("--engine-multiplex", "true" if args.generate_stream == "on" else "false"),
                )
            )
            if other_cpus:
                os.sched_setaffinity(0, other_cpus)
        for gateway in gateways.values():
            measure(gateway, args, 1.0, other_cpus)  # warm-up
        rounds: dict[int, list[Round]] = {workers: [] for workers in gateways}
        for _ in range(args.rounds):
            for workers, gateway in gateways.items():
                rounds[workers].append(measure(gateway, args, args.seconds, other_cpus))
    best = {workers: max(results, key=lambda r: r.tokens_per_s) for workers, results in rounds.items()}
    for workers, result in best.items():
        events = f"{result.events / result.seconds:9.0f} SSE events/s" if result.events is not None else ""
        print(
            f"  --workers {workers}: {result.tokens_per_s:9.0f} tokens/s {events} "
            f"({result.requests / result.seconds:6.0f} streams/s)  "
            f"gateway {result.gateway_cpu_s / result.seconds:4.2f} CPU-s/s, "
            f"{result.tokens / max(result.gateway_cpu_s, 1e-9):7.0f} tokens per gateway CPU-s;  "
            f"clients {result.client_cpu_s / result.seconds:4.2f} CPU-s/s"
        )
        print("      rounds (tokens/s): " + ", ".join(f"{r.tokens_per_s:.0f}" for r in rounds[workers]))
    ratio = best[args.workers].tokens_per_s / best[1].tokens_per_s
    print(f"  throughput ratio --workers {args.workers} / --workers 1: {ratio:.2f}")


if __name__ == "__main__":
    main()
