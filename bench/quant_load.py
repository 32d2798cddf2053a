"""Load time of the 134M model with int8 weights against float32 (load_model alone: read, quantize,
prepack), alternating in rounds, best of each; the goal is within 1.5x of float32.

    .venv/bin/python bench/quant_load.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import random_llama_110m

from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.loader import load_model
from conduit_engine.models.quantization import plan_quantization
from conduit_engine.ops import get_ops

CASES = (
    ("float32", "none", False),
    ("int8, LM head float32", "int8", False),
    ("int8 (default)", "int8", True),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = random_llama_110m()
    arch = read_arch_config(folder)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for label, quantization, head in CASES:
            plan = plan_quantization(folder, quantization, head)
            started = time.perf_counter()
            model = load_model(folder, arch, get_ops("cpu"), torch.float32, "cpu", 512, quantization=plan)
            best[label] = min(best.get(label, float("inf")), time.perf_counter() - started)
            del model
    base = best["float32"]
    for label, seconds in best.items():
        print(f"{label:<24} {seconds:6.2f} s  {seconds / base:5.2f}x float32")


if __name__ == "__main__":
    main()
