"""Gateway overhead: the same streams through the gateway (SSE) and straight over gRPC, same engine, same run.

    .venv/bin/python bench/gateway_overhead.py [--model PATH] [--streams 64] [--max-tokens 128] [--rounds 2]

Three paths, each with a client that costs little next to what it measures (each prints its CPU-seconds,
with the engine's and the gateway's, since on a small machine a client's CPU is taken from the engine):
- direct, one GenerateStream: every request opened in one batch of actions on one stream, one batch read
  per engine step; the engine's cheapest API, and the baseline of the goals;
- direct, a Generate call each: one grpc.aio call per request (the client alone costs more CPU than the
  gateway; shown for reference);
- gateway SSE: the gateway in front (which itself uses one GenerateStream), its SSE read from raw sockets
  (event boundaries only; JSON parsed for the usage event alone).

Prints output tokens/s and median inter-token latency (per stream: decode time / (tokens - 1)) for each
path and the ratios of the gateway against direct GenerateStream (goals: throughput ratio >= 0.9, latency
ratio <= 1.1) and against a Generate call each, then the gateway alone against an instant fake engine: SSE
events/s. Rounds alternate the paths so drift on a shared machine hits all; the best round of each counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import grpc  # noqa: E402
from proc_stats import cpu_seconds  # noqa: E402
from sse_reader import SseReader  # noqa: E402

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.support.processes import ManagedProcess, free_port, start_engine, start_gateway  # noqa: E402

PROMPT = "Once upon a time"


@dataclass
class RunResult:
    tokens: int = 0
    events: int = 0
    seconds: float = 0.0
    # Per stream: mean gap between content events, (last - first) / (events - 1). Robust to a client
    # that reads several buffered events in one go, which would make raw gaps look like zero.
    stream_itls: list[float] = field(default_factory=list)
    # CPU-seconds over the run: this process (the client), the engine, the gateway (0 for direct gRPC).
    client_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    gateway_cpu_s: float = 0.0

    def add_stream(self, first: float | None, last: float | None, content_events: int) -> None:
        if first is not None and last is not None and content_events > 1:
            self.stream_itls.append((last - first) / (content_events - 1))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds

    @property
    def median_itl_ms(self) -> float:
        return statistics.median(self.stream_itls) * 1000 if self.stream_itls else float("nan")


class SseStream(SseReader):
    """One streamed completion: its events, its content events' times, and the usage event's JSON (the
    only one parsed)."""

    def __init__(self, request: bytes, result: RunResult, done: asyncio.Future[None]) -> None:
        super().__init__(request, done)
        self.result = result
        self.first: float | None = None
        self.last: float | None = None
        self.content = 0

    def event(self, data: bytes, now: float) -> None:
        self.result.events += 1
        if b'"usage":{' in data:
            self.result.tokens += json.loads(data[6:])["usage"]["completion_tokens"]
        if b'"text":"' in data and b'"text":""' not in data:
            self.last = now
            self.first = self.first or now
            self.content += 1

    def connection_lost(self, exc) -> None:
        self.result.add_stream(self.first, self.last, self.content)
        super().connection_lost(exc)


async def run_gateway(url: str, model: str, streams: int, max_tokens: int) -> RunResult:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    result = RunResult()
    loop = asyncio.get_running_loop()

    async def one() -> None:
        done = loop.create_future()
        await loop.create_connection(lambda: SseStream(request, result, done), host, int(port))
        await done

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(streams)))
    result.seconds = time.perf_counter() - started
    return result


async def grpc_stream(
    stub: engine_pb2_grpc.EngineStub, request: engine_pb2.GenerateRequest, result: RunResult
) -> None:
    first = last = None
    content = 0
    final_tokens = 0
    async for message in stub.Generate(request):
        result.events += 1
        final_tokens = message.usage.completion_tokens
        if message.text:
            last = time.perf_counter()
            first = first or last
            content += 1
    result.tokens += final_tokens
    result.add_stream(first, last, content)


async def run_direct(address: str, streams: int, max_tokens: int) -> RunResult:
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    result = RunResult()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        started = time.perf_counter()
        await asyncio.gather(
            *(
                grpc_stream(
                    stub,
                    engine_pb2.GenerateRequest(request_id=f"bench-{i}", text=PROMPT, sampling=sampling),
                    result,
                )
                for i in range(streams)
            )
        )
        result.seconds = time.perf_counter() - started
    return result


def measured(pids: tuple[int, int], run: Coroutine[Any, Any, RunResult]) -> RunResult:
    """`run`, with the CPU-seconds it cost this process (the client) and the engine's and gateway's
    processes (`pids`)."""
    engine_pid, gateway_pid = pids
    before = resource.getrusage(resource.RUSAGE_SELF)
    engine, gateway = cpu_seconds(engine_pid), cpu_seconds(gateway_pid)
    result = asyncio.run(run)
    after = resource.getrusage(resource.RUSAGE_SELF)
    result.client_cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    result.engine_cpu_s = cpu_seconds(engine_pid) - engine
    result.gateway_cpu_s = cpu_seconds(gateway_pid) - gateway
    return result


def model_name(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest()).model


async def run_direct_stream(address: str, streams: int, max_tokens: int) -> RunResult:
    """The same requests straight to the engine on one GenerateStream (how the gateway itself talks to
    it): every open in one batch of actions, each message's time taken as its batch arrives."""
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    result = RunResult()
    opens = engine_pb2.GenerateStreamActions()
    for tag in range(streams):
        request = engine_pb2.GenerateRequest(request_id=f"bench-{tag}", text=PROMPT, sampling=sampling)
        opens.actions.add().open.CopyFrom(engine_pb2.GenerateStreamOpen(tag=tag, request=request))
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    content = dict.fromkeys(range(streams), 0)
    tokens = dict.fromkeys(range(streams), 0)
    ended = asyncio.Event()

    async def requests():
        yield engine_pb2.GenerateStreamRequest(batch=opens)
        await ended.wait()  # then the client's side closes, and the stream ends

    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        started = time.perf_counter()
        call = stub.GenerateStream(requests())
        left = streams
        async for batch in call:
            now = time.perf_counter()
            for item in batch.messages:
                message = item.message
                result.events += 1
                tokens[item.tag] = message.usage.completion_tokens
                if message.text:
                    last[item.tag] = now
                    first.setdefault(item.tag, now)
                    content[item.tag] += 1
            left -= len(batch.ends)
            if left == 0:
                ended.set()
        result.seconds = time.perf_counter() - started
    result.tokens = sum(tokens.values())
    for tag in range(streams):
        result.add_stream(first.get(tag), last.get(tag), content[tag])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not Path(args.model).is_dir():
        raise SystemExit(f"{args.model} is missing (../shared must sit beside the checkout, or pass --model)")

    print(f"engine: {args.model}; {args.streams} concurrent streams x {args.max_tokens} greedy tokens")
    with (
        start_engine(args.model, "--max-num-seqs", str(args.streams)) as engine,
        start_gateway(engine.address, "--log-level", "warning") as gateway,
    ):
        name = model_name(engine.address)
        asyncio.run(run_direct(engine.address, 4, 8))  # warm-up
        asyncio.run(run_direct_stream(engine.address, 4, 8))
        asyncio.run(run_gateway(gateway.url, name, 4, 8))
        runs: dict[str, list[RunResult]] = {"calls": [], "stream": [], "gateway": []}
        pids = (engine.process.pid, gateway.process.pid)
        for _ in range(args.rounds):
            runs["gateway"].append(
                measured(pids, run_gateway(gateway.url, name, args.streams, args.max_tokens))
            )
            runs["stream"].append(
                measured(pids, run_direct_stream(engine.address, args.streams, args.max_tokens))
            )
            runs["calls"].append(measured(pids, run_direct(engine.address, args.streams, args.max_tokens)))
    best = {path: max(results, key=lambda r: r.tokens_per_s) for path, results in runs.items()}
    gw, dr, calls = best["gateway"], best["stream"], best["calls"]
    labels = {
        "calls": "direct, a Generate call each",
        "stream": "direct, one GenerateStream",
        "gateway": "gateway SSE",
    }
    for path, result in best.items():
        label = labels[path]
        print(
            f"  {label:29}: {result.tokens_per_s:9.1f} tok/s   median ITL {result.median_itl_ms:7.2f} ms"
            f"   ({result.tokens} tokens; CPU-s: client {result.client_cpu_s:.2f}, engine"
            f" {result.engine_cpu_s:.2f}, gateway {result.gateway_cpu_s:.2f}; wall {result.seconds:.2f} s)"
        )
    print(f"  throughput ratio gateway/direct  {gw.tokens_per_s / dr.tokens_per_s:.3f}   (goal >= 0.9)")
    print(f"  median ITL ratio gateway/direct  {gw.median_itl_ms / dr.median_itl_ms:.3f}   (goal <= 1.1)")
    print(
        f"  against a Generate call each: throughput {gw.tokens_per_s / calls.tokens_per_s:.3f},"
        f" median ITL {gw.median_itl_ms / calls.median_itl_ms:.3f}"
    )

    fake_port = free_port()
    fake_args = [sys.executable, "-m", "tests.support.fake_engine", "--port", str(fake_port)]
    with ManagedProcess("fake-engine", fake_args, fake_port) as fake:
        with start_gateway(fake.address, "--log-level", "warning") as gateway:
            asyncio.run(run_gateway(gateway.url, "fake-model", 4, 8))
            alone = max(
                (
                    asyncio.run(run_gateway(gateway.url, "fake-model", args.streams, args.max_tokens))
                    for _ in range(args.rounds)
                ),
                key=lambda r: r.events_per_s,
            )
    print(
        f"gateway alone (instant fake engine): {alone.events_per_s:9.1f} SSE events/s "
        f"({alone.events} events, {args.streams} streams)"
    )


if __name__ == "__main__":
    main()
