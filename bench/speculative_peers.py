"""Speculative decoding on the full stack beside llama-server: the same input-grounded and free workloads
as bench/speculative.py, sent over HTTP to Conduit (engine + gateway, run_stack) and to llama.cpp's
llama-server on a GGUF of the same weights, each without speculation and with its own n-gram (and
draft-model) speculation, one server after the other in one run.

    .venv/bin/python bench/speculative_peers.py [--k 4] [--requests 32] [--methods ngram draft]
        [--peers conduit llama.cpp] [--rounds 2]

Conduit's n-gram is prompt lookup (`prompt_lookup_min` 2, `prompt_lookup_max` 5); llama-server's is
`--spec-type ngram-simple` (a 2-token lookup, `--spec-ngram-simple-size-m` k). The draft model is
stories260K cut to its first 4 layers (bench/speculative.py's), for llama-server a GGUF of it (`-md`).
Requests: greedy, `ignore_eos`, prompts as token ids (the grounded prompts hold BOS inside them), each
with its max_tokens; concurrency 1 runs 8 requests one after the other, concurrency 16 `--requests` of
them 16 at a time. Printed: output tokens per wall-clock second (the best of `--rounds`) and each
configuration's ratio to the same server without speculation, then Conduit ÷ llama-server per row.
Wall-clock time: the servers are separate processes, so the machine must be quiet for the figures to
mean much.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import stories_path  # noqa: E402
from speculative import draft_folder, make_engine, workloads  # noqa: E402

from bench.peer_servers import PeerServer, ServeJob, ensure_built  # noqa: E402

Request = tuple[list[int], int]
CONCURRENCY = (1, 16)


async def drive(url: str, model: str, requests: list[Request], concurrency: int) -> tuple[int, float]:
    """Send `requests` with at most `concurrency` in flight; (output tokens, wall seconds)."""
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt, max_tokens = queue.get_nowait()
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            reply = await client.post(f"{url}/v1/completions", json=body, timeout=300)
            reply.raise_for_status()
            tokens += reply.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient() as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return tokens, time.perf_counter() - started


def measure(
    peer: str, job: ServeJob, sets: dict[str, list[Request]], args: argparse.Namespace
) -> dict[tuple[str, int], float]:
    """Best tok/s of each (workload, concurrency) on one server."""
    rates: dict[tuple[str, int], float] = {}
    with PeerServer(peer, job) as server:
        for concurrency in CONCURRENCY:
            for workload, requests in sets.items():
                batch = requests[: 8 if concurrency == 1 else args.requests]
                asyncio.run(drive(server.url, job.name, batch[:concurrency], concurrency))  # warm-up
                best = 0.0
                for _ in range(args.rounds):
                    tokens, seconds = asyncio.run(drive(server.url, job.name, batch, concurrency))
                    best = max(best, tokens / seconds)
                rates[(workload, concurrency)] = best
                print(
                    f"   {peer} {job.speculative:5} {workload:8} c={concurrency:<2} {best:8.0f} tok/s",
                    flush=True,
                )
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per step")
    parser.add_argument("--requests", type=int, default=32, help="requests per workload at c=16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=["ngram", "draft"], default=["ngram", "draft"])
    parser.add_argument(
        "--peers", nargs="+", choices=["conduit", "llama.cpp"], default=["conduit", "llama.cpp"]
    )
    parser.add_argument("--draft-layers", type=int, default=4)
    args = parser.parse_args()
    ensure_built(args.peers)
    target = stories_path()
    sets = workloads(make_engine(target, 16, None), args.requests)
    draft = draft_folder(target, args.draft_layers) if "draft" in args.methods else None
    configs = ["none", *args.methods]
    table: dict[tuple[str, str], dict[tuple[str, int], float]] = {}
    for peer in args.peers:
        for spec in configs:
            job = ServeJob(
                model_dir=target,
                name=target.name,
                dtype="float32",
                max_num_seqs=max(CONCURRENCY),
                context_per_seq=512,
                threads=os.cpu_count() or 1,
                speculative=spec,
                spec_k=args.k,
                draft_dir=draft,
            )
            print(f"-- {peer}, speculation {spec} ...", flush=True)
            try:
                table[(peer, spec)] = measure(peer, job, sets, args)
            except Exception as exc:  # one server failing keeps the others' figures
                print(f"-- {peer}, speculation {spec} failed: {exc}", flush=True)
    print(
        f"\nstories260K, k = {args.k}, output tok/s (best of {args.rounds}); "
        "(x): against the same server without speculation"
    )
    print(
        f"{'workload':9} {'c':>3} {'speculation':11} "
        + " ".join(f"{p:>18}" for p in args.peers)
        + "  conduit÷llama"
    )
    for concurrency in CONCURRENCY:
        for workload in sets:
            for spec in configs:
                cells, values = [], []
                for peer in args.peers:
                    rate = table.get((peer, spec), {}).get((workload, concurrency))
                    base = table.get((peer, "none"), {}).get((workload, concurrency))
                    values.append(rate)
                    if rate is None:
                        cells.append(f"{'-':>18}")
                    else:
                        ratio = f"({rate / base:.2f}x)" if base and spec != "none" else ""
                        cells.append(f"{rate:>10.0f} {ratio:>7}")
                versus = (
                    f"{values[0] / values[1]:.2f}" if len(values) == 2 and values[0] and values[1] else "-"
                )
                print(f"{workload:9} {concurrency:>3} {spec:11} " + " ".join(cells) + f"  {versus:>12}")


if __name__ == "__main__":
    main()
