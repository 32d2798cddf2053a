"""`--quantization int8` against float32 in the engine, side by side on the same weights and requests:
load time and output tokens/s at each concurrency, in interleaved rounds (on a busy machine each pair of
runs sees about the same load; compare the ratios, not the absolute figures).

    .venv/bin/python bench/quant_throughput.py [--model 110m|stories] [--concurrency 1 16] [--rounds 3]
        [--tokens 128] [--float-lm-head]

Prints every run, then per concurrency the best float32 and int8 rates and int8 ÷ float32.
"""

from __future__ import annotations

import argparse
import time

from common import random_llama_110m, request_set, stories_path
from engine_throughput import run_engine

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine


def make_engine(folder, quantization: str, seqs: int, lm_head: bool) -> tuple[LLMEngine, float]:
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(
                path=str(folder),
                quantization=quantization,
                quantize_lm_head=lm_head,
            ),
            cache=CacheConfig(num_blocks=16 * max(seqs, 4)),
            scheduler=SchedulerConfig(max_num_seqs=max(seqs, 1), max_num_batched_tokens=2048),
        )
    )
    return engine, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["110m", "stories"], default="110m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--float-lm-head", action="store_true", help="--quantize-lm-head false")
    args = parser.parse_args()
    folder = random_llama_110m() if args.model == "110m" else stories_path()
    vocab = 32000 if args.model == "110m" else 512
    best: dict[tuple[str, int], float] = {}
    loads: dict[str, list[float]] = {"none": [], "int8": []}
    for r in range(args.rounds):
        for c in args.concurrency:
            requests = request_set(c, vocab, seed=c, output_range=(args.tokens, args.tokens + 1))
            for quant in ("none", "int8"):
                engine, load_s = make_engine(folder, quant, c, not args.float_lm_head)
                loads[quant].append(load_s)
                try:
                    tokens, seconds, _ = run_engine(engine, requests)
                finally:
                    engine.shutdown()
                rate = tokens / seconds
                best[(quant, c)] = max(best.get((quant, c), 0.0), rate)
                line = f"round {r} c={c:<3} {quant:<5} {rate:8.1f} tok/s ({tokens} tokens)"
                print(f"{line}, engine start {load_s:.2f} s")
    print(f"\n{args.model}{' (LM head float32)' if args.float_lm_head else ''}: best of {args.rounds} rounds")
    print(f"{'c':>4} {'float32 tok/s':>14} {'int8 tok/s':>11} {'int8/f32':>9}")
    for c in args.concurrency:
        f, q = best[("none", c)], best[("int8", c)]
        print(f"{c:>4} {f:>14.1f} {q:>11.1f} {q / f:>9.2f}")
    print(
        f"engine start (load + prepack), min of rounds: float32 {min(loads['none']):.2f} s, "
        f"int8 {min(loads['int8']):.2f} s ({min(loads['int8']) / min(loads['none']):.2f}x)"
    )


if __name__ == "__main__":
    main()
