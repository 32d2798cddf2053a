"""Conduit beside llama.cpp's llama-server and vLLM CPU on the same weights, the same machine, the same
client (bench/serving.py) and the same workload, one server after the other in one run; prints the
ratio table of output tok/s (Conduit ÷ llama.cpp, Conduit ÷ vLLM).

    .venv/bin/python bench/peers.py                                   # the full table (f32)
    .venv/bin/python bench/peers.py --dtype bfloat16                  # bf16 rows, llama-server on a bf16 GGUF
    .venv/bin/python bench/peers.py --quantization int8 --peers conduit llama.cpp  # int8 rows vs q8_0
    .venv/bin/python bench/peers.py --models stories --concurrency 1 64 --peers conduit llama.cpp

Builds missing peers with ../shared/peers/*.sh (llama-server ~10 min, vLLM ~3 min, once). Workload:
PROMPT_LEN-token prompts of real text, OUTPUT_LEN greedy tokens with ignore_eos, streamed /v1/completions.
Needs the bench tools (`make bench-setup`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # for common

from common import random_llama_110m, stories_path  # noqa: E402

from bench.loadgen.client import Target  # noqa: E402
from bench.loadgen.report import TableRow, format_ratio_table, format_run  # noqa: E402
from bench.loadgen.results import RunResult, append_result  # noqa: E402
from bench.loadgen.runner import LoadPlan  # noqa: E402
from bench.loadgen.workload import LengthDist  # noqa: E402
from bench.peer_servers import PeerServer, ServeJob, ensure_built, vllm_refusal  # noqa: E402
from bench.serving import SweepConfig, run_sweep  # noqa: E402
from tests.support.processes import ProcessStartError  # noqa: E402

PEERS = ("conduit", "llama.cpp", "vllm")
CONTEXT_MARGIN = 16


@dataclass(frozen=True)
class ModelSpec:
    """A model of the table: how to get its folder, its default concurrencies, its fewest requests."""

    title: str
    folder: Callable[[], Path]
    concurrencies: tuple[int, ...]
    min_requests: int


MODELS = {
    "134m": ModelSpec("random Llama 768×12 (134M, untied head)", random_llama_110m, (1, 16), 8),
    "stories": ModelSpec("stories260K", stories_path, (1, 64), 32),
}


def requests_for(spec: ModelSpec, concurrency: int, fixed: int | None) -> int:
    """Enough requests that every slot runs at least two of them, and at least spec.min_requests."""
    return fixed or max(spec.min_requests, 2 * concurrency)


def bench_server(
    peer: str, job: ServeJob, plans: list[tuple[LoadPlan, int]], args: argparse.Namespace
) -> list[RunResult]:
    """Start `peer`, send the workload at each concurrency, stop it."""
    results = []
    with PeerServer(peer, job) as server:
        for plan, n in plans:
            config = SweepConfig(
                target=Target(base_url=server.url, model=job.name),
                plans=[plan],
                num_requests=n,
                prompt_len=LengthDist.parse(str(args.prompt_len)),
                output_len=LengthDist.parse(str(args.output_len)),
                tokenizer=job.model_dir,
                seed=args.seed,
                label=f"{peer} {job.name}",
                progress=not args.no_progress,
            )
            (result,) = run_sweep(config)
            print(format_run(result), flush=True)
            results.append(result)
    return results


def run_peer(
    peer: str, job: ServeJob, plans: list[tuple[LoadPlan, int]], args: argparse.Namespace
) -> list[RunResult] | None:
    """bench_server, started again (--start-retries) when the server dies before it is ready; None when
    it fails, so that one peer failing does not lose the others' figures."""
    for attempt in range(1 + args.start_retries):
        print(f"-- {peer} on {job.name} ({args.dtype}) ...", flush=True)
        try:
            return bench_server(peer, job, plans, args)
        except ProcessStartError as exc:
            print(f"-- {peer} on {job.name} did not start (attempt {attempt + 1}): {exc}", flush=True)
            if peer == "llama.cpp" and job.llama_repack:
                # llama-server's AMX repacked q8_0 kernels segfault in its warm-up on some Sapphire Rapids
                # VMs (seen 2026-12-04); its plain CPU kernels are what it can serve with there
                print("-- llama.cpp: starting again with --no-repack", flush=True)
                job = dataclasses.replace(job, llama_repack=False)
        except Exception as exc:
            print(f"-- {peer} on {job.name} failed: {exc}", flush=True)
            return None
    return None


def bench_model(key: str, args: argparse.Namespace, out: Path) -> list[TableRow]:
    spec = MODELS[key]
    folder = spec.folder()
    concurrencies = args.concurrency or spec.concurrencies
    job = ServeJob(
        model_dir=folder,
        name=folder.name,
        dtype=args.dtype,
        max_num_seqs=max(concurrencies),
        context_per_seq=args.prompt_len + args.output_len + CONTEXT_MARGIN,
        threads=os.cpu_count() or 1,
        quantization=args.quantization,
    )
    plans = [(LoadPlan("concurrency", c), requests_for(spec, c, args.requests)) for c in concurrencies]
    tok_s: dict[tuple[str, int], float | None] = {}
    for peer in args.peers:
        refusal = vllm_refusal(folder) if peer == "vllm" else None
        if peer == "vllm" and args.quantization != "none":
            refusal = "no int8 rows for vLLM (its CPU build takes no W8A8 int8 for these models)"
        if refusal:
            print(f"-- {peer} on {job.name}: skipped, {refusal}", flush=True)
            continue
        results = run_peer(peer, job, plans, args)
        if results is None:
            continue
        for (plan, _), result in zip(plans, results, strict=True):
            append_result(out, result)
            ok = result.summary["failed"] == 0
            tok_s[(peer, int(plan.value))] = result.summary["output_tok_s"] if ok else None
    suffix = "" if args.dtype == "float32" else f", {args.dtype}"
    if args.quantization == "int8":
        suffix += ", Conduit --quantization int8 vs llama.cpp q8_0"
    return [
        TableRow(f"{spec.title}{suffix}", c, {p: tok_s.get((p, c)) for p in args.peers})
        for c in concurrencies
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--concurrency", type=int, nargs="+", help="instead of each model's defaults")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--quantization",
        choices=["none", "int8"],
        default="none",
        help="int8: Conduit --quantization int8 against llama-server on a q8_0 GGUF of the same weights",
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens, BOS included")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests", type=int, help="per concurrency (default: max(min, 2 x c))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON Lines of every run (default: a temporary file)")
    parser.add_argument("--plot", type=Path, help="draw every run into this PNG")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--start-retries", type=int, default=1, help="starts again of a server that died")
    args = parser.parse_args()
    if "conduit" not in args.peers:
        parser.error("--peers: conduit must be one of them (the table divides by it)")
    return args


def main() -> None:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="conduit-peers-")) / "runs.jsonl"
    ensure_built(args.peers)
    started = time.time()
    rows = [row for key in args.models for row in bench_model(key, args, out)]
    peers = [p for p in PEERS if p in args.peers]
    print(f"\n{shlex.join([Path(sys.executable).name, *sys.argv])}   ({math.ceil(time.time() - started)} s)")
    print(
        f"output tok/s, streamed /v1/completions, {args.prompt_len}-token prompts, {args.output_len} tokens "
        f"with ignore_eos, {os.cpu_count()} cores; runs in {out}\n"
    )
    print(format_ratio_table(rows, peers))
    if args.plot:
        from bench.loadgen.results import read_results
        from bench.plot import plot_runs

        plot_runs(read_results(out), args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
