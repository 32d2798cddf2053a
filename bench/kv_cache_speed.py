"""Decode speed at a long context with the KV cache in the compute dtype against int8 and fp8 caches
(--kv-cache-dtype), side by side in one process: the 110M random Llama (bench/common.py, float32),
`--batch` sequences of `--context` prompt tokens each, then `--tokens` greedy tokens; the time counted is
from every sequence's first token to the last one (decode only). Configurations alternate for `--rounds`
rounds so that load on a shared machine falls on all of them alike; the best round of each is printed,
with its ratio to auto.

    .venv/bin/python -m bench.kv_cache_speed [--context 1900] [--batch 1 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

from bench.common import random_llama_110m
from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams

KV_DTYPES = ("auto", "int8", "fp8")


def decode_rate(engine: LLMEngine, batch: int, context: int, tokens: int, round_: int) -> float:
    """Tokens a second from the last sequence's first token (all of them decoding) to the end."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [1] + [(round_ * 7919 + i * 104729 + p * 31) % 31000 + 3 for p in range(context - 1)]
        engine.add_request(GenerationRequest(f"r{round_}-{i}", params, token_ids=prompt))
    first: dict[str, float] = {}
    produced: list[tuple[float, int]] = []
    while engine.has_work():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            produced.append((now, len(out.token_ids)))
    start = max(first.values())
    counted = [(t, n) for t, n in produced if t > start]
    return sum(n for _, n in counted) / (counted[-1][0] - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1900)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-kernels", default="auto")
    args = parser.parse_args()
    folder = random_llama_110m()
    blocks = max(args.batch) * ((args.context + args.tokens) // 16 + 2)
    engines = {
        kv: LLMEngine(
            EngineConfig(
                model=ModelConfig(path=str(folder), dtype="float32", cpu_kernels=args.cpu_kernels),
                cache=CacheConfig(num_blocks=blocks, kv_cache_dtype=kv, enable_prefix_caching=False),
                scheduler=SchedulerConfig(max_num_seqs=max(args.batch), max_num_batched_tokens=2048),
            )
        )
        for kv in KV_DTYPES
    }
    print(f"110M float32, context {args.context}, {args.tokens} greedy tokens, best of {args.rounds} rounds")
    print("| batch | KV cache | decode tok/s (all sequences) | vs auto |")
    print("|---|---|---|---|")
    for batch in args.batch:
        best = dict.fromkeys(KV_DTYPES, 0.0)
        for round_ in range(args.rounds):
            for kv, engine in engines.items():
                best[kv] = max(best[kv], decode_rate(engine, batch, args.context, args.tokens, round_))
        for kv in KV_DTYPES:
            print(f"| {batch} | {kv} | {best[kv]:.1f} | {best[kv] / best['auto']:.2f}x |")


if __name__ == "__main__":
    main()
