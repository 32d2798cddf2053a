"""Engine vs transformers generate() on the same weights, same requests, same run: output tokens/s.

    .venv/bin/python bench/engine_throughput.py [--model stories|110m|both] [--requests 64]
                                                [--cpu-kernels auto torch]   # CPU ops side by side

Also prints the share of engine step time spent in scheduling + block management (goal < 10%).
"""

from __future__ import annotations

import argparse
import time

from common import hf_static_batches, random_llama_110m, request_set, stories_path

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine import LLMEngine
from conduit_engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams


def run_engine(folder, requests, max_num_seqs: int, cpu_kernels: str = "auto") -> tuple[int, float, float]:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder), cpu_kernels=cpu_kernels),
            cache=CacheConfig(num_blocks=16 * max_num_seqs),  # 256 tokens per sequence
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
        )
    )
    # warm-up outside the timed region
    engine.add_request(
        GenerationRequest("w", SamplingParams(max_tokens=4, temperature=0), token_ids=[1, 5, 6])
    )
    while engine.has_work():
        engine.step()
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", params, token_ids=prompt))
    # Everything of a step but the model run is scheduling, block management and postprocessing.
    model_time = [0.0]
    execute = engine.runner.execute

    def timed_execute(out):
        t0 = time.perf_counter()
        try:
            return execute(out)
        finally:
            model_time[0] += time.perf_counter() - t0

    engine.runner.execute = timed_execute
    tokens, step_time = 0, 0.0
    while engine.has_work():
        t0 = time.perf_counter()
        outputs = engine.step()
        step_time += time.perf_counter() - t0
        tokens += sum(len(o.token_ids) for o in outputs)
    return tokens, time.perf_counter() - start, step_time - model_time[0]


def bench(name: str, folder, n: int, hf_batch: int, max_num_seqs: int, cpu_kernels: list[str]) -> None:
    vocab = 512 if name == "stories260K" else 32000
    requests = request_set(n, vocab)
    h_tokens, h_time = hf_static_batches(folder, requests, hf_batch)
    h_rate = h_tokens / h_time
    print(
        f"{name}: {n} requests, transformers generate() batch {hf_batch} {h_rate:,.0f} tok/s ({h_time:.1f} s)"
    )
    first = None
    for choice in cpu_kernels:
        e_tokens, e_time, e_sched = run_engine(folder, requests, max_num_seqs, choice)
        e_rate = e_tokens / e_time
        first = first or e_rate
        print(
            f"  engine (--cpu-kernels {choice}) {e_rate:,.0f} tok/s ({e_tokens} tokens, {e_time:.1f} s) | "
            f"÷ transformers {e_rate / h_rate:.2f}x | ÷ first engine run {e_rate / first:.2f}x | "
            f"scheduling + block management + postprocess: {100 * e_sched / e_time:.1f}% of engine time"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["stories", "110m", "both"], default="both")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--cpu-kernels", nargs="+", default=["auto"], help="CPU ops to run, side by side")
    args = parser.parse_args()
    kernels = args.cpu_kernels
    if args.model in ("stories", "both"):
        bench("stories260K", stories_path(), args.requests, args.hf_batch, args.max_num_seqs, kernels)
    if args.model in ("110m", "both"):
        bench(
            "random-llama-110M", random_llama_110m(), args.requests, args.hf_batch, args.max_num_seqs, kernels
        )


if __name__ == "__main__":
    main()
