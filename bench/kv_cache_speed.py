"""Decode speed at a long context with the KV cache in the compute dtype against int8 and fp8 caches
(--kv-cache-dtype), side by side in one process: the 110M random Llama (bench/common.py, float32),
`--batch` sequences of `--context` prompt tokens each, then `--tokens` greedy tokens; the time counted is
from every sequence's first token to the last one (decode only). Configurations alternate for `--rounds`
rounds so that load on a shared machine falls on all of them alike; the best round of each is printed,
with its ratio to auto. `--op` times the decode attention op alone instead (the CPU kernels over
one layer's cache of the same shape, 12 heads of 64, the median of many calls, interleaved).

    .venv/bin/python -m bench.kv_cache_speed [--context 1900] [--batch 1 4] [--tokens 64] [--op]
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


def op_rows(context: int, batches: list[int], repeats: int = 30) -> None:
    """Median time of one decode attention call per KV dtype, calls interleaved."""
    import statistics

    import torch

    from conduit_engine.ops import cpu_kernels
    from conduit_engine.ops.base import AttentionMetadata
    from conduit_engine.ops.cpu_ops import CpuOps
    from conduit_engine.ops.kv_quant import cache_layout, quantize

    ops = CpuOps(cpu_kernels.supported_isas()[0])
    heads, head_dim, block = 12, 64, 16
    print(f"decode attention op ({ops.isa}), 12 heads x 64, context {context}, median of {repeats} calls")
    print("| batch | KV cache | ms per call | vs auto |")
    print("|---|---|---|---|")
    for batch in batches:
        blocks = -(-context // block)
        values = torch.randn(batch * blocks, block, heads, head_dim)
        caches = {}
        for kv in KV_DTYPES:
            dtype, _ = cache_layout(kv, torch.float32, head_dim)
            caches[kv] = values if kv == "auto" else quantize(values, dtype)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.int64),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.full((batch,), context, dtype=torch.int32),
            block_tables=torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks),
            query_lens_cpu=(1,) * batch,
            seq_lens_cpu=(context,) * batch,
            block_size=block,
        )
        q = torch.randn(batch, heads, head_dim)
        step = ops.begin_step(torch.zeros(batch, dtype=torch.int64), meta, torch.zeros(1, 2))
        times: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
        for _ in range(repeats):
            for kv, cache in caches.items():
                started = time.perf_counter()
                ops.attention(q, cache, cache, step, head_dim**-0.5)
                times[kv].append(time.perf_counter() - started)
        median = {kv: statistics.median(t) for kv, t in times.items()}
        for kv in KV_DTYPES:
            print(f"| {batch} | {kv} | {1e3 * median[kv]:.3f} | {median['auto'] / median[kv]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1900)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-kernels", default="auto")
    parser.add_argument("--op", action="store_true", help="time the decode attention op alone")
    args = parser.parse_args()
    if args.op:
        op_rows(args.context, args.batch)
        return
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
