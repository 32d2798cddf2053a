"""The CPU kernels' int8 linear (W8A8, `--quantization int8`) against their float32 linear, side by side
on the same weights, at the batch sizes a step sees.

    .venv/bin/python bench/int8_linear.py [--isa auto] [--rows 1 4 16 64 256]

Shapes are the 134M model's projections (bench/cpu_linear.py). Prints milliseconds per call (best of
three rounds) and float32 ÷ int8 (> 1: int8 is faster). Both include everything a call does (int8:
quantizing x per token; float32 from 32 rows: torch's GEMM, as PackedLinear hands it over).
"""

from __future__ import annotations

import argparse

import torch
from cpu_linear import SHAPES, best_ms

from conduit_engine.ops import cpu_kernels, quant
from conduit_engine.ops.cpu_ops import CpuOps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="auto", help="auto (the best this CPU runs) or one of them")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = parser.parse_args()
    isa = cpu_kernels.supported_isas()[0] if args.isa == "auto" else args.isa
    ops = CpuOps(isa)
    print(f"kernels: {isa}, torch threads {torch.get_num_threads()}")
    print(f"{'weight':<8} {'rows':>5} {'float32 ms':>11} {'int8 ms':>8} {'f32/int8':>9}")
    torch.manual_seed(0)
    alive = []  # CpuOps finds prepacked weights by address: keep every weight alive, as a model does
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k)
        q, scale = quant.quantize_weight(weight)
        alive += [weight, q, scale]
        ops.prepare_linear(weight)
        ops.prepare_linear(q, scale)
        for rows in args.rows:
            x = torch.randn(rows, k)
            reps = max(3, 2000 // (rows * 8))
            f32 = best_ms(lambda: ops.linear(x, weight), reps)  # noqa: B023
            i8 = best_ms(lambda: ops.linear(x, q, None, scale), reps)  # noqa: B023
            print(f"{name:<8} {rows:>5} {f32:>11.3f} {i8:>8.3f} {f32 / i8:>9.2f}")


if __name__ == "__main__":
    main()
