"""The CPU kernels' LoRA delta alone: CPU time (this thread's, so other load on a shared machine counts
less than in wall time) of the deltas of every projection of the 20M random Llama's 6 layers (q/k/v,
o, gate/up, down; rank 16, float32) for one step of T rows spread over 8, 4 and 1 adapters, against
the base projections of the same step on the packed linear kernels.

    .venv/bin/python bench/lora_kernel.py [--rows 16 528] [--isa avx2] [--iterations 30]

16 rows is the decode step of bench/lora.py's batch, 528 its prefill (16 prompts of 33 tokens). A
layer's pools are its own tensors, as in the engine, so 8 adapters' weights (22 MB) stream from memory
each step rather than from the cache.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from conduit_engine.ops import cpu_kernels

HIDDEN, INTER, LAYERS, SLOTS, RANK = 384, 1024, 6, 8, 16
SHAPES = {"qkv": (HIDDEN, (HIDDEN,) * 3), "o": (HIDDEN, (HIDDEN,)), "gate_up": (HIDDEN, (INTER, INTER))}
SHAPES["down"] = (INTER, (HIDDEN,))


def cpu_ms(fn, iterations: int) -> float:
    fn()
    started = time.thread_time()
    for _ in range(iterations):
        fn()
    return (time.thread_time() - started) / iterations * 1e3


def make_layers(module, kernels, rows: int) -> list[tuple[object, object, torch.Tensor]]:
    """(LoRA pool, packed base weight, input rows) of every projection of every layer."""
    layers = []
    for _ in range(LAYERS):
        for k, splits in SHAPES.values():
            n = sum(splits)
            a = torch.randn(SLOTS, len(splits), RANK, k) / k**0.5
            b = torch.randn(SLOTS, len(splits) * RANK, n) * 0.01
            pool = module.LoraLayer(a, b, list(splits))
            layers.append((pool, kernels.pack_linear(torch.randn(n, k)), torch.randn(rows, k)))
    return layers


def run_base(layers) -> None:
    for _, weight, x in layers:
        weight.forward(x, None)


def run_deltas(kernels, layers, outs, slots: torch.Tensor) -> None:
    for (pool, _, x), y in zip(layers, outs, strict=True):
        kernels.lora_delta(y, x, pool, slots)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 528])
    parser.add_argument("--isa", default=None, help="default: the best this CPU runs")
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    module = cpu_kernels.load()
    isa = args.isa or module.supported_isas()[0]
    kernels = getattr(module, isa)
    torch.manual_seed(0)
    print(f"CPU kernels ({isa}), {torch.get_num_threads()} threads, rank {RANK}, {LAYERS} layers, float32")
    print("| rows | adapters | base projections ms | LoRA deltas ms | LoRA / base |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        layers = make_layers(module, kernels, rows)
        outs = [weight.forward(x, None) for _, weight, x in layers]
        base = cpu_ms(functools.partial(run_base, layers), max(1, args.iterations // 4))
        for adapters in (8, 4, 1):
            per_prompt = max(1, rows // 16)  # a prompt's rows are one run, prompt i on adapter i % adapters
            slots = torch.tensor([(t // per_prompt) % adapters for t in range(rows)], dtype=torch.int32)
            lora = cpu_ms(functools.partial(run_deltas, kernels, layers, outs, slots), args.iterations)
            print(f"| {rows} | {adapters} | {base:.2f} | {lora:.2f} | {lora / base:.3f} |")


if __name__ == "__main__":
    main()
