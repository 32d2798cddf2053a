"""Gateway throughput per token: a cheap fake engine streams tokens at a fixed rate through a real gateway to
a cheap SSE client, each in its own process; the gateway's CPU-seconds say what each token costs it.

    .venv/bin/python bench/gateway_throughput.py [--baseline-commit REV | --baseline-path DIR] [--direct]
        [--streams 64,256,1024] [--tokens 128] [--step-ms 10] [--cases all|chat,chat-usage,...] [--rounds 1]

The fake engine (bench/stream_fake_engine.py, its own process) answers Generate and GenerateStream with
pre-serialised GenerateResponse messages (one token each, text "§"): every stream gets its next token at
each tick of a ticker shared by all streams of the same rate (a decode step); the request's `seed` is the
tick in ms (so one engine serves every rate).
The client (`client` subcommand) opens one raw asyncio connection per stream, sends the request and only
finds event boundaries: it counts `data:` events, the "§" inside each event's delta text (tokens; several
when events were coalesced), and the gap between a stream's content events as it reads them (ITL).

Per case it prints: tokens/s delivered, SSE events/s, the gateway's CPU-seconds over the run (utime + stime
from /proc/PID/stat, all its threads), tokens per gateway CPU-second, ITL p50/p99 at the client, the
gateway's RSS after the run, and the client's own CPU-seconds (it is not the bottleneck while they stay
well under the wall time). With a baseline, each case runs on the baseline gateway then on this one, side
by side (same engine, same machine state), and the ratios are printed: with `--rounds N`, the two
alternate N times per case and the median of the rounds' ratios is printed.

With `--direct`, each case also runs against the fake engine's process serving the same SSE itself (the
events a plain stream of the gateway writes, same shape and size, one per tick of the same ticker): what
a minimal SSE server leaves of the client's ITL on this machine, this client included. The `added` row is
the gateway's ITL p50 and p99 less the direct ones (median over rounds): the ITL the gateway adds. (Its
"gw cpu" is then the engine process's, which also serves gRPC.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

from proc_stats import cpu_seconds, rss_mib  # noqa: E402
from sse_reader import SseReader  # noqa: E402
from stream_fake_engine import WORD  # noqa: E402

WORD_BYTES = WORD.encode()
API_KEY = "sk-bench-throughput"


# -- client ------------------------------------------------------------------------------------------------


class SseStream(SseReader):
    """One request on its own connection: counts events, errors and the delta text's tokens (several when
    events were coalesced), and the gaps between its content events."""

    def __init__(self, request: bytes, marker: bytes, done: asyncio.Future[None], gaps: list[float]) -> None:
        super().__init__(request, done)
        self.marker, self.gaps = marker, gaps
        self.events = self.tokens = self.errors = 0
        self.last: float | None = None

    def event(self, data: bytes, now: float) -> None:
        self.events += 1
        if b'"error"' in data:
            self.errors += 1
        text_at = data.find(self.marker)
        if text_at >= 0:
            text_at += len(self.marker)
            tokens = data.count(WORD_BYTES, text_at, data.index(b'"', text_at))
            if tokens:
                self.tokens += tokens
                if self.last is not None:
                    self.gaps.append(now - self.last)
                self.last = now


async def client_main(args: argparse.Namespace) -> dict[str, float]:
    body = json.loads(args.body)
    payload = json.dumps(body).encode()
    headers = [
        f"POST {args.path} HTTP/1.1",
        "Host: bench",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        "Connection: close",
    ]
    if args.api_key:
        headers.append(f"Authorization: Bearer {args.api_key}")
    request = ("\r\n".join(headers) + "\r\n\r\n").encode() + payload
    marker = b'"content":"' if args.path.endswith("chat/completions") else b'"text":"'
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    host, port = args.url.removeprefix("http://").split(":")
    streams = []
    started = time.perf_counter()

    async def one() -> SseStream:
        done = loop.create_future()
        _, protocol = await loop.create_connection(
            lambda: SseStream(request, marker, done, gaps), host, int(port)
        )
        await done
        return protocol

    streams = await asyncio.gather(*(one() for _ in range(args.streams)))
    seconds = time.perf_counter() - started
    gaps.sort()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "seconds": seconds,
        "tokens": sum(s.tokens for s in streams),
        "events": sum(s.events for s in streams),
        "errors": sum(s.errors for s in streams) + sum(1 for s in streams if not s.status_ok),
        "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else float("nan"),
        "itl_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)] if gaps else float("nan"),
        "client_cpu_s": usage.ru_utime + usage.ru_stime,
    }


# -- orchestration -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    api: str  # chat | completions
    usage: bool = False
    logprobs: bool = False
    secured: bool = False  # API keys file + tracing on

    def body(self, tokens: int, step_ms: int) -> dict:
        body: dict = {"model": "fake-model", "max_tokens": tokens, "stream": True, "seed": step_ms}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": "Once upon a time"}]
            if self.logprobs:
                body.update(logprobs=True, top_logprobs=2)
        else:
            body["prompt"] = "Once upon a time"
            if self.logprobs:
                body["logprobs"] = 2
        if self.usage:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"


CASES = {
    case.name: case
    for case in (
        Case("chat", "chat"),
        Case("chat-usage", "chat", usage=True),
        Case("chat-logprobs", "chat", logprobs=True),
        Case("chat-keys-tracing", "chat", usage=True, secured=True),
        Case("completions", "completions"),
        Case("completions-usage", "completions", usage=True),
        Case("completions-logprobs", "completions", logprobs=True),
    )
}


def run_client(url: str, case: Case, streams: int, tokens: int, step_ms: int, pid: int) -> dict[str, float]:
    args = [sys.executable, __file__, "client", "--url", url, "--path", case.path, "--streams", str(streams)]
    args += ["--body", json.dumps(case.body(tokens, step_ms))]
    if case.secured:
        args += ["--api-key", API_KEY]
    before = cpu_seconds(pid)
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the client failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    result["gateway_cpu_s"] = cpu_seconds(pid) - before
    result["rss_mib"] = rss_mib(pid)
    return result


class Profile:
    """py-spy sampling a gateway process over one run (`--py-spy PREFIX`): the raw stacks go to a file
    (flamegraph.pl and speedscope read it), and the frames with the most samples of their own are
    printed, each with its inclusive share."""

    def __init__(self, pid: int, path: Path) -> None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.path = path
        self._process = subprocess.Popen(
            [spy, "record", "-p", str(pid), "-r", "250", "--format", "raw", "-o", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self, top: int = 12) -> None:
        self._process.send_signal(signal.SIGINT)  # py-spy writes what it sampled, then exits
        self._process.wait(timeout=30)
        if not self.path.exists():
            print(f"  py-spy wrote nothing to {self.path} (is `make bench-setup` done?)")
            return
        own: dict[str, int] = {}
        within: dict[str, int] = {}
        total = 0
        for line in self.path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            samples, frames = int(count), stack.split(";")
            total += samples
            own[frames[-1]] = own.get(frames[-1], 0) + samples
            for frame in set(frames):
                within[frame] = within.get(frame, 0) + samples
        print(f"  py-spy: {total} samples in {self.path}; own / inclusive share of the most sampled frames:")
        for frame, samples in sorted(own.items(), key=lambda item: -item[1])[:top]:
            print(f"    {100 * samples / total:5.1f}% / {100 * within[frame] / total:5.1f}%  {frame}")


def baseline_tree(args: argparse.Namespace, scratch: Path) -> Path | None:
    if args.baseline_path:
        return Path(args.baseline_path).resolve()
    if not args.baseline_commit:
        return None
    tree = scratch / "baseline"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", args.baseline_commit, "services"], check=True, capture_output=True
    ).stdout
    archive_path = scratch / "baseline.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(tree, filter="data")
    return tree


def gateway_env(tree: Path | None, service: str = "gateway") -> dict[str, str]:
    """The environment that runs `service` (gateway or engine) from `tree`'s sources (None: this checkout)."""
    if tree is None:
        return {}
    paths = [tree / "services" / service / "src", tree / "services" / "common" / "src"]
    paths.append(REPO / "protos" / "python" / "gen")  # generated, not in git; the proto is the same
    return {"PYTHONPATH": os.pathsep.join(str(path) for path in paths)}


def per_cpu_s(result: dict[str, float]) -> float:
    return result["tokens"] / result["gateway_cpu_s"] if result["gateway_cpu_s"] else float("nan")


def median_ratios(pairs: list[tuple[dict[str, float], dict[str, float]]]) -> str:
    """current / baseline of each round's pair, the median over rounds: tokens/s, events/s, tokens per
    CPU-second, ITL p50 and p99."""

    def median(values: list[float]) -> float:
        return statistics.median(values)

    def ratio(after: float, before: float) -> float:
        return after / before if before else float("nan")

    tps = median([(a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"]) for b, a in pairs])
    eps = median([(a["events"] / a["seconds"]) / (b["events"] / b["seconds"]) for b, a in pairs])
    cpu = median([per_cpu_s(a) / per_cpu_s(b) for b, a in pairs])
    p50 = median([ratio(a["itl_p50_ms"], b["itl_p50_ms"]) for b, a in pairs])
    p99 = median([ratio(a["itl_p99_ms"], b["itl_p99_ms"]) for b, a in pairs])
    return f"{tps:9.2f} {eps:9.2f} {'':7} {cpu:9.2f} {p50:7.2f} {p99:7.2f}"


def wait_listening(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")
        time.sleep(0.1)


def added_itl(direct: list[dict[str, float]], current: list[dict[str, float]]) -> str:
    """ITL p50 and p99 through this gateway less those of the engine's own SSE (`--direct`), ms: the
    median over rounds of each round's difference."""
    p50 = statistics.median(c["itl_p50_ms"] - d["itl_p50_ms"] for d, c in zip(direct, current, strict=True))
    p99 = statistics.median(c["itl_p99_ms"] - d["itl_p99_ms"] for d, c in zip(direct, current, strict=True))
    return f"{'':9} {'':9} {'':7} {'':9} {p50:7.2f} {p99:7.2f}  (ms, ITL current - direct)"


def fmt(result: dict[str, float]) -> str:
    tps = result["tokens"] / result["seconds"]
    eps = result["events"] / result["seconds"]
    return (
        f"{tps:9.0f} {eps:9.0f} {result['gateway_cpu_s']:7.2f} {per_cpu_s(result):9.0f}"
        f" {result['itl_p50_ms']:7.2f} {result['itl_p99_ms']:7.2f} {result['rss_mib']:6.0f}"
        f" {result['client_cpu_s']:6.2f}/{result['seconds']:5.1f}"
        + (f"  ERRORS {result['errors']}" if result["errors"] else "")
    )


HEADER = (
    f"{'case':22} {'streams':>7} {'gateway':9} {'tok/s':>9} {'events/s':>9} {'gw cpu':>7} {'tok/cpu-s':>9}"
    f" {'p50 ms':>7} {'p99 ms':>7} {'RSS MiB':>6} {'client cpu/wall':>12}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client")
    client.add_argument("--url", required=True)
    client.add_argument("--path", required=True)
    client.add_argument("--streams", type=int, required=True)
    client.add_argument("--body", required=True)
    client.add_argument("--api-key")
    parser.add_argument("--streams", default="64,256,1024", help="comma-separated concurrent streams")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument(
        "--step-ms", default="10", help="engine tick per stream, ms (comma-separated: several)"
    )
    parser.add_argument("--cases", default="all", help=f"comma-separated of {', '.join(CASES)}")
    parser.add_argument(
        "--full-matrix",
        action="store_true",
        help="every case at every stream count (default: every case at 256, chat at the others)",
    )
    parser.add_argument("--baseline-commit", help="also run the gateway of this git revision, side by side")
    parser.add_argument("--baseline-path", help="also run the gateway of this checkout, side by side")
    parser.add_argument("--rounds", type=int, default=1, help="runs per case and gateway, alternating")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="also run each case against the fake engine's own SSE (no gateway): the ITL the gateway adds",
    )
    parser.add_argument("--gateway-args", default="", help="extra gateway flags (space-separated)")
    parser.add_argument(
        "--py-spy",
        metavar="PREFIX",
        help="profile each run's gateway with py-spy (make bench-setup): PREFIX-LABEL-CASE-STREAMS.txt",
    )
    args = parser.parse_args()
    if args.command == "client":
        print(json.dumps(asyncio.run(client_main(args))))
        return

    from tests.support.otlp_receiver import OtlpReceiver
    from tests.support.processes import ManagedProcess, free_port, start_gateway

    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    counts = [int(n) for n in args.streams.split(",")]
    steps = [int(s) for s in args.step_ms.split(",")]
    plan = [
        (CASES[name], streams, step)
        for step in steps
        for streams in counts
        for name in names
        if args.full_matrix or streams == 256 or name == "chat" or len(counts) == 1
    ]
    scratch = Path(tempfile.mkdtemp(prefix="conduit-gwtp-"))
    keys_file = scratch / "keys.yaml"
    keys_file.write_text(
        f"keys:\n  - name: bench\n    key: {API_KEY}\n    limits:\n      requests_per_minute: 1000000\n"
        "      tokens_per_minute: 1000000000\n"
    )
    try:
        tree = baseline_tree(args, scratch)
        port, sse_port = free_port(), free_port()
        fake = str(Path(__file__).with_name("stream_fake_engine.py"))
        engine_args = [sys.executable, fake, "--port", str(port), "--sse-port", str(sse_port)]
        with ManagedProcess("throughput-engine", engine_args, port) as engine, OtlpReceiver() as otlp:
            gateways: dict[tuple[str, bool], ManagedProcess] = {}
            if args.direct:
                wait_listening(sse_port)
            variants: list[tuple[str, Path | None]] = [("direct", None)] if args.direct else []
            variants += [("baseline", tree)] if tree is not None else []
            variants.append(("current", None))
            base = ["--log-level", "warning", "--max-concurrent-requests", "4096", *args.gateway_args.split()]
            secured = ["--api-keys-file", str(keys_file), "--otlp-endpoint", otlp.endpoint]
            print(
                f"fake engine: one token per message, text {WORD!r}, {args.tokens} tokens per stream, "
                f"tick {args.step_ms} ms per stream; CPU: {os.cpu_count()} cores, "
                f"load average {os.getloadavg()[0]:.2f} at start"
            )
            print(HEADER)
            try:
                for case, streams, step in plan:
                    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in variants}
                    for round_index in range(args.rounds):
                        # Alternate which goes first, so that drift on a shared machine hits both.
                        order = variants if round_index % 2 == 0 else variants[::-1]
                        for label, tree_path in order:
                            name = f"{case.name}@{step}ms"
                            if label == "direct":  # the engine's process serves the SSE itself
                                url = f"http://127.0.0.1:{sse_port}"
                                result = run_client(url, case, streams, args.tokens, step, engine.process.pid)
                                runs[label].append(result)
                                print(f"{name:22} {streams:7} {label:9} {fmt(result)}", flush=True)
                                continue
                            key = (label, case.secured)
                            if key not in gateways:
                                extra = base + (secured if case.secured else [])
                                gw = start_gateway(engine.address, *extra, env=gateway_env(tree_path))
                                gateways[key] = gw
                                warm = Case("warm", case.api, secured=case.secured)
                                run_client(gw.url, warm, 8, 8, 1, gw.process.pid)
                            gw = gateways[key]
                            profile = None
                            if args.py_spy:
                                out = Path(f"{args.py_spy}-{label}-{name}-{streams}.txt").resolve()
                                profile = Profile(gw.process.pid, out)
                            result = run_client(gw.url, case, streams, args.tokens, step, gw.process.pid)
                            runs[label].append(result)
                            print(f"{name:22} {streams:7} {label:9} {fmt(result)}", flush=True)
                            if profile is not None:
                                profile.stop()
                    if "baseline" in runs:
                        pairs = list(zip(runs["baseline"], runs["current"], strict=True))
                        label = "ratio" if len(pairs) == 1 else "median"
                        print(f"{'':22} {'':7} {label:9} {median_ratios(pairs)}", flush=True)
                    if "direct" in runs:
                        print(
                            f"{'':22} {'':7} {'added':9} {added_itl(runs['direct'], runs['current'])}",
                            flush=True,
                        )
            finally:
                for gw in gateways.values():
                    gw.stop()
            print(f"load average {os.getloadavg()[0]:.2f} at end; one run per row, ratios current / baseline")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
