"""The CPU kernels' linear (prepacked panels, or torch's GEMM from 32 float32 rows) against torch's own
`F.linear`, side by side on the same weights, at the batch sizes a step sees.

    .venv/bin/python bench/cpu_linear.py [--isa auto] [--rows 1 4 16 32 64 256] [--dtype float32 bfloat16]

Shapes are the 134M model's projections (hidden 768, intermediate 2048, fused qkv and gate|up). Prints
milliseconds per call (best of three rounds) and the ratio torch ÷ kernels (> 1: the kernels are faster).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from conduit_engine.ops import cpu_kernels
from conduit_engine.ops.cpu_ops import CpuOps

SHAPES = {
    "qkv": (2304, 768),
    "o": (768, 768),
    "gate_up": (4096, 768),
    "down": (768, 2048),
    "lm_head": (32000, 768),
}


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="auto", help="auto (the best this CPU runs) or one of them")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 256])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    isa = cpu_kernels.supported_isas()[0] if args.isa == "auto" else args.isa
    ops = CpuOps(isa)
    print(f"kernels: {isa}, torch threads {torch.get_num_threads()}")
    print(f"{'dtype':<9} {'weight':<8} {'rows':>5} {'kernels ms':>11} {'torch ms':>9} {'torch/kernels':>14}")
    torch.manual_seed(0)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for name, (n, k) in SHAPES.items():
            weight = torch.randn(n, k).to(dtype)
            ops.prepare_linear(weight)
            for rows in args.rows:
                x = torch.randn(rows, k).to(dtype)
                reps = max(3, 2000 // (rows * 8))
                ours = best_ms(lambda: ops.linear(x, weight), reps)  # noqa: B023
                theirs = best_ms(lambda: torch.nn.functional.linear(x, weight), reps)  # noqa: B023
                ratio = theirs / ours
                print(f"{dtype_name:<9} {name:<8} {rows:>5} {ours:>11.3f} {theirs:>9.3f} {ratio:>14.2f}")


if __name__ == "__main__":
    main()
