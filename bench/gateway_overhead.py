"""Gateway overhead: the same streams through the gateway (SSE) and straight over gRPC, same engine, same run.

    .venv/bin/python bench/gateway_overhead.py [--model PATH] [--streams 64] [--max-tokens 128] [--rounds 2]

Prints output tokens/s and median inter-token latency (per stream: decode time / (tokens - 1)) for both
paths and their ratios (goals: throughput ratio >= 0.9, latency ratio <= 1.1), then the gateway alone
against an instant fake engine: SSE events/s. Rounds alternate gateway and direct runs so drift on a
shared machine hits both; the best round of each counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import grpc  # noqa: E402
import httpx  # noqa: E402

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


async def sse_stream(client: httpx.AsyncClient, body: dict, result: RunResult) -> None:
    first = last = None
    content = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            result.events += 1
            if event.get("usage"):
                result.tokens += event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
                content += 1
    result.add_stream(first, last, content)


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
    result = RunResult()
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(sse_stream(client, body, result) for _ in range(streams)))
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


def model_name(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest()).model


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
        asyncio.run(run_gateway(gateway.url, name, 4, 8))
        via_gateway: list[RunResult] = []
        direct: list[RunResult] = []
        for _ in range(args.rounds):
            via_gateway.append(asyncio.run(run_gateway(gateway.url, name, args.streams, args.max_tokens)))
            direct.append(asyncio.run(run_direct(engine.address, args.streams, args.max_tokens)))
    gw = max(via_gateway, key=lambda r: r.tokens_per_s)
    dr = max(direct, key=lambda r: r.tokens_per_s)
    for label, result in (("direct gRPC", dr), ("gateway SSE", gw)):
        print(
            f"  {label} : {result.tokens_per_s:9.1f} tok/s   median ITL {result.median_itl_ms:7.2f} ms"
            f"   ({result.tokens} tokens)"
        )
    print(f"  throughput ratio gateway/direct  {gw.tokens_per_s / dr.tokens_per_s:.3f}   (goal >= 0.9)")
    print(f"  median ITL ratio gateway/direct  {gw.median_itl_ms / dr.median_itl_ms:.3f}   (goal <= 1.1)")

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
