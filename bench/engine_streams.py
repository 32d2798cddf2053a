"""The engine's gRPC serving path before and after a change, side by side: C concurrent greedy requests
straight over gRPC (no gateway), each its own Generate call, to this checkout's engine and to a baseline
revision's, and the same requests on one GenerateStream (the baseline's too where it serves one; this
checkout's also with every open in one batch of actions), in alternating rounds.

    .venv/bin/python bench/engine_streams.py --baseline-commit REV [--concurrency 1 64 256]
        [--tokens 128] [--rounds 3] [--model PATH]

Per case and round: output tokens/s and the engine process's CPU-seconds per 1,000 tokens (utime + stime
from /proc, all its threads); then the medians and the median ratio of each case to the baseline's
Generate. The client is one grpc.aio process (this one), the same for every case.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import grpc  # noqa: E402
from common import stories_path  # noqa: E402
from gateway_throughput import baseline_tree, gateway_env  # noqa: E402
from proc_stats import cpu_seconds  # noqa: E402

from conduit.engine.v1 import engine_pb2 as pb  # noqa: E402
from conduit.engine.v1 import engine_pb2_grpc  # noqa: E402
from tests.support.processes import start_engine  # noqa: E402


def _request(index: int, tokens: int) -> pb.GenerateRequest:
    prompt = [1] + [5 + (index * 7 + j) % 400 for j in range(31)]
    sampling = pb.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


async def _per_call(address: str, concurrency: int, tokens: int) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)

        async def one(index: int) -> int:
            return sum([len(message.token_ids) async for message in stub.Generate(_request(index, tokens))])

        return sum(await asyncio.gather(*(one(i) for i in range(concurrency))))


async def _one_stream(address: str, concurrency: int, tokens: int, batched: bool = False) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        actions: asyncio.Queue[pb.GenerateStreamRequest] = asyncio.Queue()
        opens = [
            pb.GenerateStreamRequest(open=pb.GenerateStreamOpen(tag=index, request=_request(index, tokens)))
            for index in range(concurrency)
        ]
        if batched:  # every open in one write (an engine whose GetModelInfo has generate_stream_batch_bytes)
            actions.put_nowait(pb.GenerateStreamRequest(batch=pb.GenerateStreamActions(actions=opens)))
        else:
            for action in opens:
                actions.put_nowait(action)

        async def requests():
            while True:
                yield await actions.get()

        call = stub.GenerateStream(requests())
        received, ended = 0, 0
        async for batch in call:
            received += sum(len(item.message.token_ids) for item in batch.messages)
            ended += len(batch.ends)
            if ended == concurrency:
                call.cancel()
                break
        return received


def _serves_generate_stream(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    return info.generate_stream


def measure(engine, case: str, concurrency: int, tokens: int) -> tuple[float, float]:
    """(tokens/s, engine CPU-seconds per 1,000 tokens) of one round."""
    before, started = cpu_seconds(engine.process.pid), time.perf_counter()
    if case == "call":
        received = asyncio.run(_per_call(engine.address, concurrency, tokens))
    else:
        received = asyncio.run(_one_stream(engine.address, concurrency, tokens, batched=case == "batch"))
    seconds, cpu = time.perf_counter() - started, cpu_seconds(engine.process.pid) - before
    return received / seconds, 1000 * cpu / received


HEADER = f"{'c':>4} {'case':18} {'tok/s':>9} {'CPU-s/1k tok':>13} {'tok/s ratio':>12} {'CPU ratio':>10}"


def compare(cases: list[tuple[str, object, str]], concurrency: int, args: argparse.Namespace) -> None:
    """Rounds of every case at one concurrency, alternating the order; prints medians and ratios."""
    for _, engine, kind in cases:  # warm-up
        measure(engine, kind, min(concurrency, 8), 16)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
    for round_index in range(args.rounds):
        for name, engine, kind in cases if round_index % 2 == 0 else cases[::-1]:
            runs[name].append(measure(engine, kind, concurrency, args.tokens))
    base = runs[cases[0][0]]
    for name, _, _ in cases:
        tps = statistics.median(r[0] for r in runs[name])
        cpu = statistics.median(r[1] for r in runs[name])
        tps_ratio = statistics.median(r[0] / b[0] for r, b in zip(runs[name], base, strict=True))
        cpu_ratio = statistics.median(r[1] / b[1] for r, b in zip(runs[name], base, strict=True))
        row = f"{concurrency:>4} {name:18} {tps:9.0f} {cpu:13.3f} {tps_ratio:12.2f} {cpu_ratio:10.2f}"
        print(row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-commit", required=True)
    parser.add_argument("--baseline-path", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="model folder (default stories260K)")
    args = parser.parse_args()
    model = args.model or str(stories_path())
    scratch = Path(tempfile.mkdtemp(prefix="conduit-engine-streams-"))
    try:
        tree = baseline_tree(args, scratch)
        # The baseline tree holds services/ only: its engine builds this checkout's kernels, which must be
        # the revision's own for the comparison to be of the serving path alone.
        changed = subprocess.run(
            ["git", "-C", str(REPO), "diff", "--quiet", args.baseline_commit, "--", "kernels"]
        )
        if changed.returncode != 0:
            raise SystemExit(
                f"kernels/ differs since {args.baseline_commit}: use bench/kernels_ab.py for that"
            )
        env = {**gateway_env(tree, "engine"), "CONDUIT_KERNELS_DIR": str(REPO / "kernels")}
        flags = ("--max-num-seqs", str(max(args.concurrency)))
        with (
            start_engine(model, *flags, env=env) as baseline,
            start_engine(model, *flags) as current,
        ):
            cases = [("baseline Generate", baseline, "call"), ("Generate", current, "call")]
            if _serves_generate_stream(baseline.address):
                cases.append(("baseline GenStream", baseline, "stream"))
            cases.append(("GenerateStream", current, "stream"))
            cases.append(("GenStream batched", current, "batch"))
            print(f"{model}, {args.tokens} greedy tokens a request, {args.rounds} rounds")
            print(HEADER)
            for concurrency in args.concurrency:
                compare(cases, concurrency, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
