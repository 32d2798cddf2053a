"""Engine start-up: process start → health SERVING, per phase, beside llama-server on the same weights.

    .venv/bin/python bench/startup.py [--model 110m|stories|PATH] [--runs 5] [--dtype float32]

Each run starts `python -m conduit_engine` with JSON logs, polls grpc.health.v1 every 5 ms and reads the
phases from its log lines' times: the interpreter and imports until gRPC listens, the weights loaded (and
prepacked for the CPU kernels), the engine built (KV cache allocated), warm-up until SERVING. Where
llama-server is built (../shared/peers/llama_server.sh), each run also starts it on a GGUF of the same
weights and times process start → /health 200, alternating the two. Medians over --runs. `--module`
runs another checkout's engine (PYTHONPATH=that checkout's services/*/src, and its CLI module).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import grpc
import httpx
from common import random_llama_110m, stories_path
from grpc_health.v1 import health_pb2, health_pb2_grpc
from peer_servers import GGUF_TYPES, LLAMA_SERVER, free_port, to_gguf

# Log messages that end each phase (the first line whose message starts so).
PHASES = (
    ("listening", "gRPC listening"),
    ("weights", "loaded "),  # the loader's line: "loaded LlamaForCausalLM (...) in X s"
    ("engine", "loaded "),  # the engine's line: "... KV blocks of ..."
    ("serving", "SERVING"),
)


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def conduit_run(model: Path, dtype: str, module: str = "conduit_engine") -> dict[str, float]:
    """Seconds from process start to the end of each phase, and to SERVING seen by a client."""
    port = free_port()
    args = [sys.executable, "-m", module, "--model", str(model), "--port", str(port)]
    args += ["--host", "127.0.0.1", "--dtype", dtype, "--log-format", "json"]
    started_wall = time.time()
    started = time.monotonic()
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not _serving(port):
            if process.poll() is not None:
                raise SystemExit(f"the engine exited: {process.stderr.read()[-3000:]}")
            time.sleep(0.005)
        figures = {"client_serving": time.monotonic() - started}
    finally:
        process.terminate()
        _, err = process.communicate(timeout=60)
    phase = 0
    for line in err.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        message = entry.get("message", "")
        name, prefix = PHASES[phase]
        is_engine_line = "KV blocks" in message
        if message.startswith(prefix) and (name != "weights" or not is_engine_line):
            if name == "engine" and not is_engine_line:
                continue
            at = datetime.fromisoformat(entry["time"]).timestamp() - started_wall
            figures[name] = at
            phase += 1
            if phase == len(PHASES):
                break
    return figures


def llama_run(gguf: Path) -> float:
    port = free_port()
    args = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2"]
    started = time.monotonic()
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                raise SystemExit("llama-server exited")
            time.sleep(0.005)
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="110m", help="110m (random 134M Llama), stories, or a folder")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES))
    parser.add_argument(
        "--module",
        default="conduit_engine",
        help="the engine's module to run (another checkout's: PYTHONPATH=its services/*/src, its module)",
    )
    args = parser.parse_args()
    model = {"110m": random_llama_110m, "stories": stories_path}.get(args.model, lambda: Path(args.model))()
    gguf = to_gguf(model, model.name, args.dtype) if LLAMA_SERVER.is_file() else None
    conduit: list[dict[str, float]] = []
    llama: list[float] = []
    conduit_run(model, args.dtype, args.module)  # warm the page cache and the kernels' build cache
    if gguf is not None:
        llama_run(gguf)
    for _ in range(args.runs):
        conduit.append(conduit_run(model, args.dtype, args.module))
        if gguf is not None:
            llama.append(llama_run(gguf))
    print(f"{model.name}, {args.dtype}, median of {args.runs} runs (seconds from process start):")
    previous = 0.0
    for name, _ in PHASES:
        at = statistics.median(run[name] for run in conduit)
        print(f"  conduit  {name:<10} at {at:6.2f}  (+{at - previous:.2f})")
        previous = at
    serving = statistics.median(run["client_serving"] for run in conduit)
    print(f"  conduit  SERVING seen by a client at {serving:.2f}")
    if llama:
        best = statistics.median(llama)
        print(f"  llama-server /health 200 at {best:.2f}; conduit / llama-server = {serving / best:.2f}")
    else:
        print("  llama-server is not built (../shared/peers/llama_server.sh): no side-by-side figure")


if __name__ == "__main__":
    main()
