"""Engine vs transformers generate() on the same weights, same requests, same run: output tokens/s.

    .venv/bin/python bench/engine_throughput.py [--model stories|110m|both] [--requests 64]
        [--tensor-parallel-size N] [--worker-process] [--num-threads T] [--skip-transformers]
        [--cpu-kernels auto torch]   # CPU ops side by side
    .venv/bin/python bench/engine_throughput.py --model 110m --compare-parallel [--requests 32] [--rounds 3]
    .venv/bin/python bench/engine_throughput.py --model stories --observe [--repeats 5]

Also prints the share of engine step time spent in scheduling + block management (goal < 10%), and,
when the model runs in worker processes, the per-step cost of broadcasting the step to them.

--compare-parallel runs, one after the other on the same requests: the model in process with two
threads, in one worker process with two threads (the cost of the split), and two tensor-parallel
workers with one thread each (TP=2 on two cores), interleaved over --rounds rounds, and prints the
best and median of each and the ratios of the best runs.

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

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.executor.multiproc import BroadcastStats, MultiprocExecutor
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.telemetry.metrics import EngineMetrics


def make_engine(
    folder,
    max_num_seqs: int,
    parallel: ParallelConfig,
    threads: int,
    cpu_kernels: str = "auto",
    max_decode_steps: int = 8,
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder), num_threads=threads, cpu_kernels=cpu_kernels),
            cache=CacheConfig(num_blocks=16 * max_num_seqs),  # 256 tokens per sequence
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_decode_steps=max_decode_steps
            ),
            parallel=parallel,
        )
    )


def warm(engine: LLMEngine) -> LLMEngine:
    """One short request through `engine`, outside any timed region."""
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
    """Wrap the model run (a step's, or a decode burst's); the returned one-item list accumulates its
    seconds."""
    model_time = [0.0]

    def timed(run):
        def timed_run(*args):
            t0 = time.perf_counter()
            try:
                return run(*args)
            finally:
                model_time[0] += time.perf_counter() - t0

        return timed_run

    engine.executor.execute = timed(engine.executor.execute)
    return model_time


def run_engine(engine: LLMEngine, requests) -> tuple[int, float, float]:
    """(output tokens, wall seconds, seconds outside the runner) for `requests`, after a warm-up."""
    warm(engine)
    if isinstance(engine.executor, MultiprocExecutor):  # count the measured steps only
        engine.executor.stats = BroadcastStats()
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


def placement(parallel: ParallelConfig, threads: int, cpu_kernels: str) -> str:
    per = f"{threads} thread{'s' if threads != 1 else ''}" if threads else "auto threads"
    if parallel.tensor_parallel_size > 1:
        where = f"TP={parallel.tensor_parallel_size} workers, {per} each"
    else:
        where = f"TP=1 {'worker process' if parallel.worker_process else 'in process'}, {per}"
    return f"{where}, --cpu-kernels {cpu_kernels}"


def measure(
    folder,
    requests,
    max_num_seqs: int,
    parallel: ParallelConfig,
    threads: int,
    cpu_kernels: str,
    max_decode_steps: int = 8,
) -> tuple[float, str]:
    """(tok/s, a line describing the run) of one engine configuration."""
    engine = make_engine(folder, max_num_seqs, parallel, threads, cpu_kernels, max_decode_steps)
    try:
        tokens, seconds, outside = run_engine(engine, requests)
        stats = engine.executor.stats if isinstance(engine.executor, MultiprocExecutor) else None
    finally:
        engine.shutdown()
    rate = tokens / seconds
    line = (
        f"{placement(parallel, threads, cpu_kernels)}, --max-decode-steps {max_decode_steps}: "
        f"{rate:,.1f} tok/s ({tokens} tokens, {seconds:.1f} s); "
        f"scheduling + block management + postprocess {100 * outside / seconds:.1f}% of engine time"
    )
    if stats is not None:
        line += f"\n    step broadcast: {stats.describe()}"
    return rate, line


def bench(name: str, folder, args: argparse.Namespace) -> None:
    """The engine once per --cpu-kernels and --max-decode-steps choice (side by side), then
    transformers unless skipped."""
    vocab = 512 if name == "stories260K" else 32000
    requests = request_set(args.requests, vocab)
    parallel = ParallelConfig(args.tensor_parallel_size, args.worker_process)
    print(f"{name}: {args.requests} requests")
    rates = []
    choices = [(kernels, steps) for kernels in args.cpu_kernels for steps in args.max_decode_steps]
    for kernels, steps in choices:
        rate, line = measure(folder, requests, args.max_num_seqs, parallel, args.num_threads, kernels, steps)
        rates.append(rate)
        print(f"  engine {line} | ÷ first engine run {rate / rates[0]:.2f}x", flush=True)
    if args.skip_transformers:
        return
    h_tokens, h_time = hf_static_batches(folder, requests, args.hf_batch)
    h_rate = h_tokens / h_time
    ratios = ", ".join(f"{k}/{n} {r / h_rate:.2f}x" for (k, n), r in zip(choices, rates, strict=True))
    print(
        f"  transformers generate() batch {args.hf_batch} {h_rate:,.1f} tok/s ({h_time:.1f} s) | "
        f"engine / transformers: {ratios}"
    )


def compare_parallel(name: str, folder, args: argparse.Namespace) -> None:
    """TP=1 in process (2 threads), TP=1 in a worker process (2 threads), TP=2 (1 thread per worker),
    interleaved over `args.rounds` rounds (other load on the machine hits all three alike), on the first
    --cpu-kernels choice."""
    vocab = 512 if name == "stories260K" else 32000
    requests = request_set(args.requests, vocab)
    kernels = args.cpu_kernels[0]
    runs = [(ParallelConfig(1, False), 2), (ParallelConfig(1, True), 2), (ParallelConfig(2, False), 1)]
    rates: list[list[float]] = [[] for _ in runs]
    print(f"{name}: {args.requests} requests, max_num_seqs {args.max_num_seqs}, {args.rounds} round(s)")
    for round_index in range(args.rounds):
        for i, (parallel, threads) in enumerate(runs):
            # one pass per step in all three: worker processes run no decode bursts
            rate, line = measure(folder, requests, args.max_num_seqs, parallel, threads, kernels, 1)
            rates[i].append(rate)
            print(f"  round {round_index + 1}: {line}", flush=True)
    # Other processes on the machine only ever slow a run down: the best run is the least disturbed.
    best = [max(r) for r in rates]
    for (parallel, threads), runs_of in zip(runs, rates, strict=True):
        spread = ", ".join(f"{r:,.1f}" for r in runs_of)
        print(
            f"  {placement(parallel, threads, kernels)}: best {max(runs_of):,.1f}, median "
            f"{statistics.median(runs_of):,.1f} tok/s (runs: {spread})"
        )
    print(
        f"  best of each: worker process / in process {best[1] / best[0]:.3f}x | "
        f"TP=2 (1 thread each) / TP=1 (2 threads) {best[2] / best[0]:.3f}x"
    )


def bench_observer(name: str, folder, args: argparse.Namespace) -> None:
    """The cost of the metrics observer: two engines in lockstep, without and with it.

    Both do exactly the same steps; per step, the observed engine's time outside the model minus the
    other's is one paired sample, and the median of all samples is the cost (robust to the other
    processes of a shared machine, which a sum or a mean is not).
    """
    n, repeats = args.requests, args.repeats
    vocab = 512 if name == "stories260K" else 32000
    requests = request_set(n, vocab)
    parallel = ParallelConfig(args.tensor_parallel_size, args.worker_process)
    kernels = args.cpu_kernels[0]
    differences: list[float] = []
    plain: list[float] = []  # the unobserved engine's step: time outside the model
    whole: list[float] = []  # the unobserved engine's step: all of it
    tokens = steps = 0
    for _ in range(repeats):
        engines = {
            # one pass per step: a decode burst's length follows timing, and the two must step alike
            observed: warm(make_engine(folder, args.max_num_seqs, parallel, args.num_threads, kernels, 1))
            for observed in (False, True)
        }
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
        for engine in engines.values():
            engine.shutdown()
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
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--worker-process", action="store_true")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (per worker); 0 = auto")
    parser.add_argument("--skip-transformers", action="store_true", help="the engine only")
    parser.add_argument(
        "--compare-parallel", action="store_true", help="TP=1, worker process, TP=2 side by side"
    )
    parser.add_argument("--rounds", type=int, default=1, help="--compare-parallel: interleaved rounds")
    parser.add_argument(
        "--observe", action="store_true", help="the metrics observer's cost (no transformers)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="--observe: paired runs, medians of all steps")
    parser.add_argument("--cpu-kernels", nargs="+", default=["auto"], help="CPU ops to run, side by side")
    parser.add_argument(
        "--max-decode-steps", type=int, nargs="+", default=[8], help="decode burst lengths, side by side"
    )
    args = parser.parse_args()
    run = bench_observer if args.observe else compare_parallel if args.compare_parallel else bench
    if args.model in ("stories", "both"):
        run("stories260K", stories_path(), args)
    if args.model in ("110m", "both"):
        run("random-llama-110M", random_llama_110m(), args)


if __name__ == "__main__":
    main()
