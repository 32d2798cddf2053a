"""Engine vs transformers generate() on the same weights, same requests, same run: output tokens/s.

    .venv/bin/python bench/engine_throughput.py [--model stories|110m|both] [--requests 64]
    .venv/bin/python bench/engine_throughput.py --model stories --observe [--repeats 5]

Also prints the share of engine step time spent in scheduling + block management (goal < 10%).

--observe instead measures what the Prometheus metrics observer (--metrics-port) costs: two engines serve
the same requests in lockstep, one step each in turn, one without observers and one with the metrics
observer, and it prints their time outside the model per step and per token (interleaving step by step
keeps other processes' noise out of the difference).
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import hf_static_batches, random_llama_110m, request_set, stories_path

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine import LLMEngine
from conduit_engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.telemetry.metrics import EngineMetrics


def warm_engine(folder, max_num_seqs: int) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder)),
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
    return engine


def submit(engine: LLMEngine, requests) -> None:
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", params, token_ids=prompt))


def time_the_model(engine: LLMEngine) -> list[float]:
    """Wrap the model run; the returned one-item list accumulates its seconds."""
    model_time = [0.0]
    execute = engine.runner.execute

    def timed_execute(out):
        t0 = time.perf_counter()
        try:
            return execute(out)
        finally:
            model_time[0] += time.perf_counter() - t0

    engine.runner.execute = timed_execute
    return model_time


def run_engine(folder, requests, max_num_seqs: int) -> tuple[int, float, float]:
    engine = warm_engine(folder, max_num_seqs)
    start = time.perf_counter()
    submit(engine, requests)
    # Everything of a step but the model run is scheduling, block management and postprocessing.
    model_time = time_the_model(engine)
    tokens, step_time = 0, 0.0
    while engine.has_work():
        t0 = time.perf_counter()
        outputs = engine.step()
        step_time += time.perf_counter() - t0
        tokens += sum(len(o.token_ids) for o in outputs)
    return tokens, time.perf_counter() - start, step_time - model_time[0]


def bench(name: str, folder, n: int, hf_batch: int, max_num_seqs: int) -> None:
    vocab = 512 if name == "stories260K" else 32000
    requests = request_set(n, vocab)
    e_tokens, e_time, e_sched = run_engine(folder, requests, max_num_seqs)
    h_tokens, h_time = hf_static_batches(folder, requests, hf_batch)
    e_rate, h_rate = e_tokens / e_time, h_tokens / h_time
    print(
        f"{name}: {n} requests, engine {e_rate:,.0f} tok/s ({e_tokens} tokens, {e_time:.1f} s) | "
        f"transformers generate() batch {hf_batch} {h_rate:,.0f} tok/s ({h_time:.1f} s) | "
        f"ratio {e_rate / h_rate:.2f}x | scheduling + block management + postprocess: "
        f"{100 * e_sched / e_time:.1f}% of engine time"
    )


def bench_observer(name: str, folder, n: int, max_num_seqs: int, repeats: int) -> None:
    """The cost of the metrics observer: two engines in lockstep, without and with it.

    Both do exactly the same steps; per step, the observed engine's time outside the model minus the
    other's is one paired sample, and the median of all samples is the cost (robust to the other
    processes of a shared machine, which a sum or a mean is not).
    """
    vocab = 512 if name == "stories260K" else 32000
    requests = request_set(n, vocab)
    differences: list[float] = []
    plain: list[float] = []  # the unobserved engine's step: time outside the model
    whole: list[float] = []  # the unobserved engine's step: all of it
    tokens = steps = 0
    for _ in range(repeats):
        engines = {observed: warm_engine(folder, max_num_seqs) for observed in (False, True)}
        engines[True].observers.append(EngineMetrics(vllm_compat=True))
        model_time = {observed: time_the_model(engine) for observed, engine in engines.items()}
        for engine in engines.values():
            submit(engine, requests)
        order = [False, True]
        while engines[False].has_work():
            order.reverse()  # neither engine always steps right after the other
            outside, total = {}, {}
            for observed in order:
                model_before = model_time[observed][0]
                t0 = time.perf_counter()
                outputs = engines[observed].step()
                total[observed] = time.perf_counter() - t0
                outside[observed] = total[observed] - (model_time[observed][0] - model_before)
            differences.append(outside[True] - outside[False])
            plain.append(outside[False])
            whole.append(total[False])
            tokens += sum(len(o.token_ids) for o in outputs)
            steps += 1
    extra, base, step = statistics.median(differences), statistics.median(plain), statistics.median(whole)
    print(
        f"{name}: {n} requests x {repeats} runs, {tokens // repeats} tokens in {steps // repeats} steps "
        f"per run | median step {1e6 * step:.0f} us, of which {1e6 * base:.0f} us outside the model, without "
        f"observers; the metrics observer adds {1e6 * extra:.1f} us/step (median of paired steps), "
        f"{1e6 * extra * steps / tokens:.2f} us/token: {100 * extra / base:+.1f}% of the time outside the "
        f"model, {100 * extra / step:+.2f}% of the step"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["stories", "110m", "both"], default="both")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--observe", action="store_true", help="the metrics observer's cost (no transformers)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="--observe: runs; the best one counts")
    args = parser.parse_args()
    if args.observe:
        if args.model in ("stories", "both"):
            bench_observer("stories260K", stories_path(), args.requests, args.max_num_seqs, args.repeats)
        if args.model in ("110m", "both"):
            bench_observer(
                "random-llama-110M", random_llama_110m(), args.requests, args.max_num_seqs, args.repeats
            )
        return
    if args.model in ("stories", "both"):
        bench("stories260K", stories_path(), args.requests, args.hf_batch, args.max_num_seqs)
    if args.model in ("110m", "both"):
        bench("random-llama-110M", random_llama_110m(), args.requests, args.hf_batch, args.max_num_seqs)


if __name__ == "__main__":
    main()
