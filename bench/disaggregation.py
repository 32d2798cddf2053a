"""Disaggregation benchmark: long prompts arriving among running decode streams, colocated serving against
one prefill engine plus one decode engine, on the same machine in the same run.

    .venv/bin/python bench/disaggregation.py [--model random-110m|stories260K|PATH] [--streams 4]
        [--stream-tokens 96] [--long-prompts 6] [--long-prompt-len 384] [--interval 2] [--no-pin]

Three configurations, each with fresh engines of one CPU thread (--num-threads 1), each engine pinned to
its own core when there are enough (taskset), behind a fresh gateway:

- colocated x1: one engine serves everything;
- colocated x2: two engines, round robin;
- 1P+1D: a prefill engine and a decode engine (--prefill-engine / --decode-engine).

The workload: `streams` clients each stream short-prompt completions of `stream-tokens` tokens back to
back; meanwhile `long-prompts` requests with prompts of `long-prompt-len` tokens (and 16 output tokens)
arrive every `interval` seconds. Printed per configuration: the inter-token latency p50/p90/p99 of the
decode streams (the gaps between their SSE chunks), TTFT p50/p99 of the decode streams and of the long
prompts, and for 1P+1D the KV bytes moved per request; then the ratios against 1P+1D; then the KV transfer
time per block, measured by pulling transfers from a prefill engine with the real gRPC transport into a
cache in this process. DistServe's claim is that decode latency stops suffering from prefill interference
once the two run apart; two cores shared with a gateway and the clients may not be able to show it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support and bench.common

import grpc  # noqa: E402
import httpx  # noqa: E402

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.support.health import engine_serving  # noqa: E402
from tests.support.processes import ENGINE_START_TIMEOUT_S, ManagedProcess, free_port, start_gateway  # noqa: E402

LONG_OUTPUT_TOKENS = 16
SHORT_PROMPT_LEN = 16
CONFIGS = {
    "colocated x1": [("--role", "both")],
    "colocated x2": [("--role", "both"), ("--role", "both")],
    "1P+1D": [("--role", "prefill"), ("--role", "decode")],
}


@dataclass
class Result:
    itls: list[float] = field(default_factory=list)  # seconds between consecutive chunks of decode streams
    stream_ttfts: list[float] = field(default_factory=list)
    long_ttfts: list[float] = field(default_factory=list)
    requests: int = 0
    kv_bytes_pulled: int = 0
    kv_bytes_saved: int = 0


def model_folder(name: str) -> Path:
    if name == "random-110m":
        from bench.common import random_llama_110m

        return random_llama_110m()
    if name == "stories260K":
        from bench.common import stories_path

        return stories_path()
    return Path(name)


def launch(model: Path, flags: list[tuple[str, ...]], args: argparse.Namespace) -> list[ManagedProcess]:
    """One engine per flag set, pinned to cores 0, 1, ... when the machine has as many; all SERVING."""
    pin = args.pin and shutil.which("taskset") and (os.cpu_count() or 1) >= len(flags)
    engines = []
    for core, extra in enumerate(flags):
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "conduit_engine.entrypoints.cli",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
        ]
        command += ["--port", str(port), "--num-threads", "1", "--max-num-seqs", "16"]
        command += ["--kv-cache-blocks", str(args.kv_cache_blocks), "--log-level", "WARNING", *extra]
        if pin:
            command = ["taskset", "-c", str(core), *command]
        engines.append(ManagedProcess("engine", command, port))
    for engine in engines:
        engine.wait_ready(lambda engine=engine: engine_serving(engine.address), ENGINE_START_TIMEOUT_S)
    return engines


async def stream(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[float]]:
    """(TTFT, arrival times of every chunk with text) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                arrivals.append(time.perf_counter())
    return arrivals[0] - started, arrivals


async def workload(url: str, model: str, vocab: int, args: argparse.Namespace) -> Result:
    rng = random.Random(args.seed)
    result = Result()
    stop = asyncio.Event()

    def prompt(length: int) -> list[int]:
        return [1, *(rng.randrange(3, vocab) for _ in range(length - 1))]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def decode_loop() -> None:
            while not stop.is_set():
                ttft, arrivals = await stream(client, model, prompt(SHORT_PROMPT_LEN), args.stream_tokens)
                result.stream_ttfts.append(ttft)
                result.itls.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
                result.requests += 1

        async def long_prompts() -> None:
            await asyncio.sleep(args.interval)  # the decode streams are running by then
            for _ in range(args.long_prompts):
                long_request = stream(client, model, prompt(args.long_prompt_len), LONG_OUTPUT_TOKENS)
                (ttft, _), _ = await asyncio.gather(long_request, asyncio.sleep(args.interval))
                result.long_ttfts.append(ttft)
                result.requests += 1
            stop.set()

        await asyncio.gather(long_prompts(), *(decode_loop() for _ in range(args.streams)))
    return result


def engine_load(address: str) -> engine_pb2.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


def model_info(address: str) -> engine_pb2.GetModelInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)


def run_config(name: str, model: Path, args: argparse.Namespace) -> tuple[Result, list[ManagedProcess]]:
    engines = launch(model, CONFIGS[name], args)
    addresses = [engine.address for engine in engines]
    if name == "1P+1D":
        gateway_args = ("", "--prefill-engine", addresses[0], "--decode-engine", addresses[1])
    else:
        gateway_args = (",".join(addresses),)
    info = model_info(addresses[0])
    with start_gateway(*gateway_args, "--log-level", "warning") as gateway:
        result = asyncio.run(workload(gateway.url, info.model, info.vocab_size, args))
    loads = [engine_load(address) for address in addresses]
    result.kv_bytes_pulled = sum(load.kv_bytes_pulled for load in loads)
    result.kv_bytes_saved = sum(load.kv_bytes_saved for load in loads)
    return result, engines


def transfer_time_per_block(prefill: str, repeats: int, prompt_len: int) -> tuple[int, int, float]:
    """(blocks, bytes per block, seconds per block): transfers produced on `prefill` pulled with the real
    gRPC transport into a cache in this process (the decode side's gather → gRPC → scatter path)."""
    import torch

    from conduit_engine.kv_transfer.cache_io import CacheBlockWriter
    from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport
    from conduit_engine.kv_transfer.layout import KvLayoutSpec
    from conduit_engine.ops.torch_ops import TorchOps
    from tests.support.kv_blocks import LocalKvBlocks, pull_spec_for

    pb = model_info(prefill).kv_layout
    layout = KvLayoutSpec(pb.model, pb.dtype, pb.block_size, pb.num_layers, pb.num_kv_heads, pb.head_dim)
    blocks = layout.num_blocks(prompt_len)
    shape = (blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    store = LocalKvBlocks(
        TorchOps(),
        [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(layout.num_layers)
        ],
    )
    rng = random.Random(1)

    async def pulls() -> float:
        transport = GrpcKvTransport(timeout_s=60)
        seconds = 0.0
        with grpc.insecure_channel(prefill) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            for _ in range(repeats):
                request = engine_pb2.GenerateRequest(
                    token_ids=engine_pb2.TokenIds(
                        ids=[1, *(rng.randrange(3, 500) for _ in range(prompt_len - 1))]
                    ),
                    sampling=engine_pb2.SamplingParams(max_tokens=4, temperature=0),
                    kv_transfer=engine_pb2.KvTransferParams(produce=engine_pb2.KvProduce()),
                )
                (message,) = list(stub.Generate(request, timeout=60))
                spec = pull_spec_for(message.kv_handle, layout, 0)
                started = time.perf_counter()
                await transport.pull(spec, CacheBlockWriter(store, layout.block_bytes, range(blocks), 0))
                seconds += time.perf_counter() - started
        await transport.close()
        return seconds / (repeats * blocks)

    return blocks, layout.block_bytes, asyncio.run(pulls())


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(p50, p90, p99) in milliseconds."""
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[89] * 1000, cuts[98] * 1000


def report(results: dict[str, Result]) -> None:
    print(
        f"{'configuration':<14} {'ITL p50':>8} {'p90':>7} {'p99':>8} {'| TTFT stream p50':>17} {'p99':>7}"
        f" {'| TTFT long p50':>15} {'p99':>8} {'| requests':>10} {'KV bytes/req':>13}"
    )
    for name, result in results.items():
        itl = quantiles(result.itls)
        stream_ttft = quantiles(result.stream_ttfts)
        long_ttft = quantiles(result.long_ttfts)
        moved = (result.kv_bytes_pulled + result.kv_bytes_saved) / result.requests if name == "1P+1D" else 0
        print(
            f"{name:<14} {itl[0]:8.1f} {itl[1]:7.1f} {itl[2]:8.1f}   {stream_ttft[0]:15.1f}"
            f" {stream_ttft[2]:7.1f}   {long_ttft[0]:13.1f} {long_ttft[2]:8.1f}   {result.requests:9d}"
            f" {moved:13,.0f}"
        )
    pd = results["1P+1D"]
    pulled = pd.kv_bytes_pulled / pd.requests
    print(
        f"(ms; 1P+1D KV per request: {pulled:,.0f} bytes pulled, "
        f"{pd.kv_bytes_saved / pd.requests:,.0f} bytes not pulled: already in the decode engine's cache)"
    )
    for name in ("colocated x1", "colocated x2"):
        ratio = [a / b for a, b in zip(quantiles(results[name].itls), quantiles(pd.itls), strict=True)]
        print(f"ITL {name} / 1P+1D: p50 {ratio[0]:.2f}x  p90 {ratio[1]:.2f}x  p99 {ratio[2]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-110m", help="random-110m, stories260K, or a model folder")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--long-prompts", type=int, default=6)
    parser.add_argument("--long-prompt-len", type=int, default=384)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--kv-cache-blocks", type=int, default=256)
    parser.add_argument("--transfer-repeats", type=int, default=5)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin engines to cores")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = model_folder(args.model)
    print(
        f"model {model.name}; {args.streams} decode streams of {args.stream_tokens} tokens; "
        f"{args.long_prompts} prompts of {args.long_prompt_len} tokens every {args.interval} s; "
        f"{os.cpu_count()} CPUs; engines pinned: {args.pin}"
    )
    results: dict[str, Result] = {}
    transfer = None
    for name in CONFIGS:
        result, engines = run_config(name, model, args)
        results[name] = result
        try:
            if name == "1P+1D":
                transfer = transfer_time_per_block(
                    engines[0].address, args.transfer_repeats, args.long_prompt_len
                )
        finally:
            for engine in engines:
                engine.stop()
    report(results)
    if transfer is not None:
        blocks, block_bytes, seconds = transfer
        print(
            f"KV transfer (gRPC on loopback, gather → PullKv → scatter): {blocks} blocks of {block_bytes:,} "
            f"bytes per pull, {seconds * 1000:.3f} ms per block ({block_bytes / seconds / 1e6:,.0f} MB/s)"
        )


if __name__ == "__main__":
    main()
