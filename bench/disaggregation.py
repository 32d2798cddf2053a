"""Disaggregation benchmark: long prompts arriving among running decode streams, colocated serving against
one prefill engine plus one decode engine, on the same machine in the same run.

    .venv/bin/python bench/disaggregation.py [--model random-110m|stories260K|PATH] [--streams 4]
        [--stream-tokens 96] [--long-prompts 6] [--long-prompt-len 384] [--interval 2] [--no-pin]
        [--transfer-only] [--transports grpc,shm,nixl] [--transfer-prompt-len 1024] [--transfer-repeats 5]

Three configurations, each with fresh engines of one CPU thread (--num-threads 1), each engine pinned to
its own core when there are enough (taskset), behind a fresh gateway:

- colocated x1: one engine serves everything;
- colocated x2: two engines, round robin;
- 1P+1D: a prefill engine and a decode engine (--prefill-engine / --decode-engine).

The workload: `streams` clients each stream short-prompt completions of `stream-tokens` tokens back to
back; meanwhile `long-prompts` requests with prompts of `long-prompt-len` tokens (and 16 output tokens)
arrive every `interval` seconds. Printed per configuration: the inter-token latency p50/p90/p99 of the
decode streams (the gaps between their SSE chunks), TTFT p50/p99 of the decode streams and of the long
prompts, and for 1P+1D the KV bytes moved per request; then the ratios against 1P+1D. Then the KV transfer
rate per transport (--transports grpc,shm,nixl; --transfer-only for just these): for each, a fresh prefill
engine with `--kv-transport` that transport produces transfers of --transfer-prompt-len tokens, pulled with
the engine's own puller and transport into a cache in this process (the best of --transfer-repeats; the
"moved by" column shows a fallback to gRPC, e.g. where NIXL cannot start). A transport named with a
`-tpN` suffix (nixl-tp2) has the source engine run with --tensor-parallel-size N: its N workers' agents
are read by this process's TP=1 cache, each token's heads from the rank holding them. DistServe's claim
is that decode latency stops suffering from prefill interference once the two run apart; two cores
shared with a gateway and the clients may not be able to show it.
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
from types import SimpleNamespace

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


TRANSPORTS = ("grpc", "shm", "nixl")


@dataclass
class TransferRate:
    """One transport's pulls: what moved them (after any fallback), blocks and bytes, and the time."""

    transport: str
    moved_by: str  # the transport the pulls went over (gRPC when the asked one could not start)
    blocks: int
    block_bytes: int
    seconds_per_pull: float

    @property
    def bytes_per_second(self) -> float:
        return self.blocks * self.block_bytes / self.seconds_per_pull


def transfer_rate(kind: str, model: Path, args: argparse.Namespace) -> TransferRate:
    """Transfers produced on a fresh prefill engine started with `--kv-transport kind`, pulled with that
    transport into a KV cache in this process (the decode side: gRPC: gather → PullKv bytes → scatter;
    shm: gather into this process's segment → scatter from it; nixl: UCX reads from the engine's cache
    straight into this cache). The best of `transfer_repeats` pulls (the machine may be loaded)."""
    import torch

    from conduit_engine.kv_transfer.cache_io import CacheBlockWriter
    from conduit_engine.kv_transfer.layout import KvLayoutSpec
    from conduit_engine.kv_transfer.puller import KvPuller
    from conduit_engine.kv_transfer.setup import start_transports
    from conduit_engine.ops.torch_ops import TorchOps
    from tests.support.kv_blocks import LocalKvBlocks, pull_spec_for

    torch.set_num_threads(1)  # as the engines here (--num-threads 1): the copies are memory-bound anyway
    blocks_needed = -(-args.transfer_prompt_len // 16) + 4
    kind, _, tp = kind.partition("-tp")  # nixl-tp2: the source engine runs tensor parallel over 2 workers
    flags = [
        ("--role", "prefill", "--kv-transport", kind, "--max-model-len", str(args.transfer_prompt_len + 8))
    ]
    if tp:
        flags[0] += ("--tensor-parallel-size", tp)
    (engine,) = launch(
        model,
        flags,
        argparse.Namespace(
            **{**vars(args), "pin": False, "kv_cache_blocks": max(args.kv_cache_blocks, blocks_needed)}
        ),
    )
    try:
        info = model_info(engine.address)
        pb = info.kv_layout
        layout = KvLayoutSpec(pb.model, pb.dtype, pb.block_size, pb.num_layers, pb.num_kv_heads, pb.head_dim)
        blocks = layout.num_blocks(args.transfer_prompt_len)
        shape = (blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        dtype = getattr(torch, layout.dtype)
        caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(layout.num_layers)
        ]
        store = LocalKvBlocks(TorchOps(), caches)
        local = start_transports(kind, SimpleNamespace(kv_caches=caches), 60)
        rng = random.Random(1)

        async def pulls() -> tuple[float, str]:
            from conduit_common.engine_dialer import PLAINTEXT

            puller = KvPuller(store, 60, None, PLAINTEXT, local)
            best = float("inf")
            with grpc.insecure_channel(engine.address) as channel:
                stub = engine_pb2_grpc.EngineStub(channel)
                for _ in range(args.transfer_repeats):
                    ids = [1, *(rng.randrange(3, 500) for _ in range(args.transfer_prompt_len - 1))]
                    request = engine_pb2.GenerateRequest(
                        token_ids=engine_pb2.TokenIds(ids=ids),
                        sampling=engine_pb2.SamplingParams(max_tokens=4, temperature=0),
                        kv_transfer=engine_pb2.KvTransferParams(produce=engine_pb2.KvProduce()),
                    )
                    (message,) = list(stub.Generate(request, timeout=120))
                    spec = pull_spec_for(message.kv_handle, layout, 0)
                    chosen = puller.choose(spec)
                    started = time.perf_counter()
                    result = await puller.transport_for(chosen).pull(
                        spec, CacheBlockWriter(store, layout.block_bytes, range(blocks), 0)
                    )
                    best = min(best, time.perf_counter() - started)
                    assert result.num_blocks == blocks
            await puller.close()
            return best, chosen

        seconds, moved_by = asyncio.run(pulls())
        if local.nixl is not None:
            local.nixl.close()
        name = f"{kind} (TP={tp}→1)" if tp else kind
        return TransferRate(name, moved_by, blocks, layout.block_bytes, seconds)
    finally:
        engine.stop()


def report_transfers(rates: list[TransferRate]) -> None:
    grpc_rate = next((r.bytes_per_second for r in rates if r.moved_by == "grpc"), None)
    print(
        f"{'KV transport':<16} {'moved by':<9} {'blocks x bytes':>18} {'ms/pull':>9} {'GB/s':>7}"
        f" {'vs gRPC':>8}"
    )
    for r in rates:
        ratio = f"{r.bytes_per_second / grpc_rate:7.1f}x" if grpc_rate else "      -"
        print(
            f"{r.transport:<16} {r.moved_by:<9} {f'{r.blocks} x {r.block_bytes:,}':>18} "
            f"{r.seconds_per_pull * 1000:9.2f} {r.bytes_per_second / 1e9:7.2f} {ratio:>8}"
        )


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
    parser.add_argument("--transfer-prompt-len", type=int, default=1024, help="tokens of each measured pull")
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help="KV transports to measure, comma-separated"
    )
    parser.add_argument(
        "--transfer-only", action="store_true", help="only the KV transfer rates, not the serving runs"
    )
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin engines to cores")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = model_folder(args.model)
    print(
        f"model {model.name}; {args.streams} decode streams of {args.stream_tokens} tokens; "
        f"{args.long_prompts} prompts of {args.long_prompt_len} tokens every {args.interval} s; "
        f"{os.cpu_count()} CPUs; engines pinned: {args.pin}"
    )
    if not args.transfer_only:
        results: dict[str, Result] = {}
        for name in CONFIGS:
            result, engines = run_config(name, model, args)
            results[name] = result
            for engine in engines:
                engine.stop()
        report(results)
    rates = [transfer_rate(kind, model, args) for kind in args.transports.split(",")]
    print(
        f"KV transfers of {args.transfer_prompt_len}-token prompts, "
        f"best of {args.transfer_repeats} pulls each:"
    )
    report_transfers(rates)


if __name__ == "__main__":
    main()
