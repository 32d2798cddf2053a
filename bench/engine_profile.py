"""Where the engine's step time goes on the CPU, at a given concurrency (in-process, no gRPC, no HTTP).

    .venv/bin/python bench/engine_profile.py [--model 134m|stories|PATH] [--concurrency 1 16]
                                             [--prompt-len 32] [--output-len 128] [--dtype float32]
                                             [--threads N] [--quantization none|int8]

For each concurrency, c requests of PROMPT_LEN random tokens each generate OUTPUT_LEN greedy tokens
(ignore_eos) together, twice:
1. timed: the wall time of each phase of a step (scheduling, input tensors, model forward, LM head,
   sampling metadata, sampler, postprocess with detokenization), from wrappers put on the engine's
   objects in this process only;
2. under torch.profiler: the self time of the torch ops inside the model forward and the LM head, by
   kind (GEMM, KV gather, KV write, attention math, the rest). Forward wall time minus its op time is
   the Python and dispatch overhead of the model code. The profiler slows small ops down, so its
   shares are taken against the profiled run's own forward time; on a tiny model (stories260K), where
   an op lasts microseconds, they are rough.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from common import random_llama_110m, request_set, stories_path
from torch.autograd.profiler import record_function

import conduit_engine.executor.in_process as in_process
import conduit_engine.worker.model_runner as model_runner
from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams

OP_KINDS = (
    ("GEMM", ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul")),
    ("KV gather (index_select)", ("aten::index_select",)),
    ("KV write (index_copy_)", ("aten::index_copy_",)),
    ("attention math (SDPA)", ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "softmax")),
)
PHASES = ("schedule", "prepare", "forward", "lm_head", "sampling_meta", "sampler", "postprocess")
MODEL_PHASES = ("forward", "lm_head")


class PhaseClock:
    """Wraps callables so that each call adds its wall time to a phase (and, when profiling, marks
    its torch ops with the phase's name)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.label_ops = False

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with record_function(f"phase::{phase}") if self.label_ops else nullcontext():
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds[phase] += time.perf_counter() - start

        return timed


class _TimedSampler:
    def __init__(self, sampler: Any, clock: PhaseClock) -> None:
        self._call = clock.wrap("sampler", sampler.__call__)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)


def instrument(engine: LLMEngine, clock: PhaseClock) -> None:
    executor, model = engine.executor, engine.executor.model
    runner = executor.runner
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    # Input preparation: the host-side lists (build_step), then the tensors (the model runner's _tensors).
    in_process.build_step = clock.wrap("prepare", in_process.build_step)
    runner._tensors = clock.wrap("prepare", runner._tensors)
    model.forward = clock.wrap("forward", model.forward)
    model.compute_logits = clock.wrap("lm_head", model.compute_logits)
    runner.sampler = _TimedSampler(runner.sampler, clock)
    model_runner.metadata_from_plan = clock.wrap("sampling_meta", model_runner.metadata_from_plan)
    engine._update = clock.wrap("postprocess", engine._update)


def make_engine(
    folder: Path, max_num_seqs: int, dtype: str, threads: int, quantization: str = "none"
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder), dtype=dtype, num_threads=threads, quantization=quantization),
            cache=CacheConfig(num_blocks=16 * max_num_seqs),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
        )
    )


def generate(engine: LLMEngine, requests: list[tuple[list[int], int]], tag: str) -> tuple[int, int, float]:
    """Run the requests to the end; returns (steps, output tokens, wall seconds)."""
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"{tag}-{i}", params, token_ids=prompt))
    steps = tokens = 0
    start = time.perf_counter()
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())  # a decode burst gives several
        steps += 1
    return steps, tokens, time.perf_counter() - start


def op_kind(name: str) -> str:
    for kind, prefixes in OP_KINDS:
        if any(name.startswith(p) for p in prefixes):
            return kind
    return "elementwise, norms, RoPE, copies"


def model_op_seconds(prof: torch.profiler.profile) -> dict[str, float]:
    """Self time of the aten ops under the forward and LM-head phases, by kind."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, phase = event.cpu_parent, None
        while parent is not None:
            if parent.name.startswith("phase::"):
                phase = parent.name.removeprefix("phase::")
            parent = parent.cpu_parent
        if phase in MODEL_PHASES:
            totals[op_kind(event.name)] += event.self_cpu_time_total / 1e6
    return totals


def _line(name: str, seconds: float, ms_per_s: float, wall: float, indent: int = 2) -> str:
    return f"{' ' * indent}{name:<34} {seconds * ms_per_s:8.3f} ms/step  {100 * seconds / wall:5.1f}%"


def report(
    c: int,
    steps: int,
    tokens: int,
    wall: float,
    phases: dict[str, float],
    profiled_phases: dict[str, float],
    ops: dict[str, float],
) -> None:
    per_step = 1000 / steps  # seconds of the run -> ms per step
    print(
        f"\nc={c}: {steps} steps, {tokens} tokens in {wall:.2f} s = {tokens / wall:,.1f} tok/s, "
        f"{wall * per_step:.2f} ms per step (share of the step's wall time in %)"
    )
    for phase in PHASES:
        print(_line(phase, phases.get(phase, 0.0), per_step, wall))
    print(_line("other (step glue)", wall - sum(phases.values()), per_step, wall))
    model_wall = sum(phases.get(p, 0.0) for p in MODEL_PHASES)
    print(f"  inside forward + lm_head ({model_wall * per_step:.2f} ms/step), by kind of torch op:")
    # Shares come from the profiled run (its own forward wall time), applied to the timed run's.
    profiled_wall = sum(profiled_phases.get(p, 0.0) for p in MODEL_PHASES)
    scale = model_wall / profiled_wall
    for kind, s in sorted(ops.items(), key=lambda kv: -kv[1]):
        print(_line(kind, s * scale, per_step, wall, indent=4))
    overhead = max(0.0, profiled_wall - sum(ops.values())) * scale
    print(_line("Python + dispatch (wall - ops)", overhead, per_step, wall, 4))


def profile_concurrency(engine: LLMEngine, clock: PhaseClock, c: int, args: argparse.Namespace) -> None:
    vocab = engine.arch.vocab_size
    # BOS + prompt_len - 1 random tokens; request_set's ranges exclude their upper end
    prompt_range = (args.prompt_len - 1, args.prompt_len)
    output_range = (args.output_len, args.output_len + 1)
    requests = request_set(c, vocab, seed=c, prompt_range=prompt_range, output_range=output_range)
    clock.seconds.clear()
    steps, tokens, wall = generate(engine, requests, f"timed{c}")
    phases = dict(clock.seconds)
    clock.seconds.clear()
    clock.label_ops = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        generate(engine, requests, f"profiled{c}")
    clock.label_ops = False
    report(c, steps, tokens, wall, phases, dict(clock.seconds), model_op_seconds(prof))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="134m", help="134m, stories or a model folder")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none")
    args = parser.parse_args()
    folder = {"134m": random_llama_110m, "stories": stories_path}.get(args.model, lambda: Path(args.model))()
    engine = make_engine(folder, max(args.concurrency), args.dtype, args.threads, args.quantization)
    clock = PhaseClock()
    instrument(engine, clock)
    print(
        f"{folder.name}, {args.dtype}, quantization {args.quantization}, "
        f"torch threads {torch.get_num_threads()}, "
        f"prompts {args.prompt_len} tokens, {args.output_len} output tokens"
    )
    generate(engine, request_set(2, engine.arch.vocab_size, prompt_range=(4, 8), output_range=(4, 8)), "warm")
    for c in args.concurrency:
        profile_concurrency(engine, clock, c, args)


if __name__ == "__main__":
    main()
