"""The engine's decode on two builds of the CPU kernels, side by side in one run: this checkout's, and
those of a baseline commit, in alternating rounds, each round a fresh process per build.

    .venv/bin/python bench/kernels_ab.py --baseline-commit REV [--model 134m|stories] [--concurrency 1 16]
                                         [--quantization int8] [--rounds 4] [--output-len 128]

The baseline's kernels/cpu is built once (its own sources and compiler flags, read from its
ops/cpu_kernels.py) into .venv/conduit-bench-kernels/REV; both sides run this checkout's Python, so the
two builds must export the same bindings. A round runs c requests of 32 random tokens that each generate
OUTPUT_LEN greedy tokens (ignore_eos), in the engine in-process (no gRPC, no HTTP), after a warm-up
batch, and reports output tok/s. Prints each build's median tok/s and the median of the per-round
ratios (current / baseline, > 1: the current build is faster).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from common import REPO, random_llama_110m, stories_path

CACHE = REPO / ".venv" / "conduit-bench-kernels"
CPU_KERNELS_PY = "services/engine/src/conduit_engine/ops/cpu_kernels.py"


def _constants(source: str) -> dict[str, tuple[str, ...]]:
    """SOURCES, CFLAGS and LDFLAGS (absent in older revisions) of a revision's cpu_kernels.py."""
    found: dict[str, tuple[str, ...]] = {"LDFLAGS": ()}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("SOURCES", "CFLAGS", "LDFLAGS"):
                found[name] = tuple(ast.literal_eval(node.value))
    return found


def build_baseline(rev: str) -> Path:
    """The library of `rev`'s kernels/cpu, built once; returns its .so."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    name = f"conduit_cpu_kernels_base_{commit[:12]}"
    folder = CACHE / commit[:12]
    library = folder / f"{name}.so"
    if library.is_file():
        return library
    from torch.utils import cpp_extension

    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "kernels/cpu", CPU_KERNELS_PY],
        capture_output=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        flags = _constants((Path(tmp) / CPU_KERNELS_PY).read_text())
        folder.mkdir(parents=True, exist_ok=True)
        print(f"building {rev}'s CPU kernels into {folder} (about a minute) ...", flush=True)
        cpp_extension.load(
            name=name,
            sources=[str(Path(tmp) / "kernels" / "cpu" / s) for s in flags["SOURCES"]],
            extra_cflags=list(flags["CFLAGS"]),
            extra_ldflags=list(flags["LDFLAGS"]),
            build_directory=str(folder),
            verbose=False,
        )
    return library


def child(args: argparse.Namespace) -> None:
    """One round on one build: prints {"tok_s": ...}."""
    from conduit_engine.ops import cpu_kernels

    if args.library != "current":
        path = Path(args.library)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cpu_kernels.load = lambda build=True: module  # every caller looks it up at call time
    from engine_profile import generate, make_engine

    folder = stories_path() if args.model == "stories" else random_llama_110m()
    engine = make_engine(folder, max(args.concurrency, 2), "float32", 0, args.quantization)
    requests = [
        ([1] + [5 + (i * 7 + j) % 400 for j in range(31)], args.output_len) for i in range(args.concurrency)
    ]
    generate(engine, requests, "warm")
    _, tokens, wall = generate(engine, requests, "timed")
    print(json.dumps({"tok_s": tokens / wall}))


def run_side(library: str, args: argparse.Namespace, concurrency: int) -> float:
    command = [sys.executable, __file__, "child", "--library", library, "--model", args.model]
    command += ["--concurrency", str(concurrency), "--quantization", args.quantization]
    command += ["--output-len", str(args.output_len)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return float(json.loads(out.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "child"])
    parser.add_argument("--baseline-commit", help="the revision whose kernels/cpu is the baseline")
    parser.add_argument("--library", default="current", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=["134m", "stories"], default="134m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--quantization", choices=["none", "int8"], default="int8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if args.mode == "child":
        args.concurrency = args.concurrency[0]
        child(args)
        return
    if not args.baseline_commit:
        parser.error("--baseline-commit is required")
    baseline = str(build_baseline(args.baseline_commit))
    started = time.time()
    print(f"{args.model}, quantization {args.quantization}, {args.output_len} tokens per request")
    print(f"{'c':>4} {'current tok/s':>14} {'baseline tok/s':>15} {'ratio':>7}  per-round ratios")
    for c in args.concurrency:
        current, base, ratios = [], [], []
        for _ in range(args.rounds):
            current.append(run_side("current", args, c))
            base.append(run_side(baseline, args, c))
            ratios.append(current[-1] / base[-1])
        print(
            f"{c:>4} {statistics.median(current):>14.1f} {statistics.median(base):>15.1f} "
            f"{statistics.median(ratios):>7.2f}  {' '.join(f'{r:.2f}' for r in ratios)}",
            flush=True,
        )
    print(f"({time.time() - started:.0f} s; current = this checkout, baseline = {args.baseline_commit})")


if __name__ == "__main__":
    main()
