"""What structured outputs cost: engine output tok/s with 0%, 50% and 100% of a batch under a JSON schema,
same batch shapes, side by side in one run; and grammar compile time p50/p99, cold and cached.

    .venv/bin/python bench/structured.py [--model stories|110m] [--batch 64] [--max-tokens 128] [--repeats 5]

Same shapes: every request has the same prompt length and generates exactly --max-tokens tokens
(`ignore_eos`; the schema is an array of at least 1,000 objects, so no document completes first), so
the three runs differ only in masking. Runs alternate (0%, 50%, 100%, 0%, ...), --repeats times each, and
the best and the median run of each share are printed: on a shared machine, other processes make single
runs noisy, so neither share is favoured by when it ran. Goal: 100%
constrained costs at most 10% at batch 64. The time split shows where a constrained step's extra time
goes: filling the bitmask (BitmaskBuilder.build), applying it (Ops.apply_token_bitmask), advancing the
matchers (GrammarState.accept) and the finish check (GrammarState.is_finished).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

from common import random_llama_110m, stories_path

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.batch_mask import BitmaskBuilder
from conduit_engine.structured.compiler import StructuredCompiler
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from conduit_engine.structured.state import GrammarState

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}
NEVER_DONE = {"type": "array", "items": PERSON, "minItems": 1000}
FRACTIONS = (0.0, 0.5, 1.0)


class Timings:
    """Wall time of some engine methods, by name, while `measure` is active."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: type, name: str, label: str) -> None:
        original = getattr(owner, name)
        seconds = self.seconds

        if isinstance(original, property):

            def timed_get(obj):
                t0 = time.perf_counter()
                try:
                    return original.fget(obj)
                finally:
                    seconds[label] += time.perf_counter() - t0

            setattr(owner, name, property(timed_get))
            return

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def make_engine(folder, batch: int, max_tokens: int, threads: int = 0) -> LLMEngine:
    blocks_per_seq = (16 + max_tokens) // 16 + 2
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder), num_threads=threads),
            cache=CacheConfig(num_blocks=blocks_per_seq * batch, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, 16 * batch)),
        )
    )


def run_batch(engine: LLMEngine, batch: int, max_tokens: int, fraction: float, tag: str) -> float:
    """Output tokens/s of one batch with `fraction` of its requests constrained."""
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, text=json.dumps(NEVER_DONE))
    engine.structured.compile_now(spec)  # compiled once, before the clock: compile time is measured apart
    constrained = round(batch * fraction)
    start = time.perf_counter()
    for i in range(batch):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            structured=spec if i < constrained else None,
        )
        prompt = [1] + [(7 * i + j) % 400 + 50 for j in range(15)]  # 16 tokens, distinct per request
        engine.add_request(GenerationRequest(f"{tag}-{i}", params, token_ids=prompt))
    tokens = 0
    while engine.has_work():
        for out in engine.step():
            tokens += len(out.token_ids)
    elapsed = time.perf_counter() - start
    assert tokens == batch * max_tokens, (tokens, batch * max_tokens)
    return tokens / elapsed


def throughput(folder, batch: int, max_tokens: int, repeats: int, threads: int) -> None:
    engine = make_engine(folder, batch, max_tokens, threads)
    timings = Timings()
    timings.wrap(BitmaskBuilder, "build", "bitmask fill")
    timings.wrap(type(engine.runner.model.ops), "apply_token_bitmask", "bitmask apply")
    timings.wrap(GrammarState, "accept", "matcher accept")
    timings.wrap(GrammarState, "is_finished", "finish check")
    run_batch(engine, batch, 8, 1.0, "warm")  # warm-up: first constrained step, buffers, backend
    best: dict[float, float] = {}
    rates: dict[float, list[float]] = defaultdict(list)
    split: dict[float, dict[str, float]] = {}
    for r in range(repeats):
        for fraction in FRACTIONS:
            timings.seconds.clear()
            t0 = time.perf_counter()
            rate = run_batch(engine, batch, max_tokens, fraction, f"r{r}-{fraction}")
            wall = time.perf_counter() - t0
            rates[fraction].append(rate)
            if rate > best.get(fraction, 0.0):
                best[fraction] = rate
                split[fraction] = {k: v / wall for k, v in timings.seconds.items()}
    print(f"\nbatch {batch}, {max_tokens} output tokens each, {repeats} alternating runs per share:")
    header = f"{'constrained':>12} {'best tok/s':>10} {'vs 0%':>6} {'median':>8} {'vs 0%':>6}"
    print(f"{header}   time share of the run")
    medians = {f: statistics.median(r) for f, r in rates.items()}
    for fraction in FRACTIONS:
        shares = ", ".join(f"{k} {100 * v:.1f}%" for k, v in split[fraction].items()) or "-"
        print(
            f"{100 * fraction:>11.0f}% {best[fraction]:>10.0f} {best[fraction] / best[0.0]:>6.3f} "
            f"{medians[fraction]:>8.0f} {medians[fraction] / medians[0.0]:>6.3f}   {shares}"
        )
    print(
        f"100% constrained costs {100 * (1 - best[1.0] / best[0.0]):.1f}% (best) / "
        f"{100 * (1 - medians[1.0] / medians[0.0]):.1f}% (median) of the throughput (goal <= 10%); "
        f"grammar work is {100 * sum(split[1.0].values()):.1f}% of the 100% run's time"
    )


def schema_variant(i: int) -> str:
    """Distinct schemas of the same size: property names and bounds vary, so no compile is cached."""
    properties = {
        f"field_{i}_{k}": {"type": "integer", "minimum": 0, "maximum": 10 + i + k} for k in range(6)
    }
    properties[f"name_{i}"] = {"type": "string", "maxLength": 8 + i % 5}
    properties[f"kind_{i}"] = {"enum": [f"a{i}", f"b{i}", "c"]}
    return json.dumps({"type": "object", "properties": properties, "required": sorted(properties)})


def compile_times(engine_folder, count: int) -> None:
    engine = make_engine(engine_folder, 1, 8)
    t0 = time.perf_counter()
    compiler: StructuredCompiler = engine.structured.compiler
    print(f"\ngrammar vocabulary built in {1000 * (time.perf_counter() - t0):.0f} ms (once per engine)")
    specs = [StructuredSpec(StructuredKind.JSON_SCHEMA, text=schema_variant(i)) for i in range(count)]
    cold, cached = [], []
    for spec in specs:
        with _clock(cold):
            compiler.submit(spec).result()
    for spec in specs:
        with _clock(cached):
            compiler.submit(spec).result()
    for name, times in (("cold", cold), ("cached", cached)):
        p50, p99 = _percentile(times, 50), _percentile(times, 99)
        print(f"compile {name:>6}: p50 {p50:8.3f} ms   p99 {p99:8.3f} ms   ({len(times)} schemas)")
    compiler.shutdown()


@contextmanager
def _clock(into: list[float]):
    t0 = time.perf_counter()
    yield
    into.append(1000 * (time.perf_counter() - t0))


def _percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["stories", "110m"], default="stories")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--compiles", type=int, default=100)
    args = parser.parse_args()
    folder = stories_path() if args.model == "stories" else random_llama_110m()
    print(f"model {folder.name}")
    throughput(folder, args.batch, args.max_tokens, args.repeats, args.threads)
    compile_times(folder, args.compiles)


if __name__ == "__main__":
    main()
