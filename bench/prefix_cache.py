"""Prefix caching on vs off, same requests, same run: output throughput and mean time to first token.

    .venv/bin/python bench/prefix_cache.py [--model stories|20m] [--requests 64] [--system-prompts 4]

Every request is one of a few long "system prompts" followed by a short prompt of its own, all
submitted at once (greedy, fixed output length). The engine runs the workload twice, prefix caching
off then on, and prints the ratios. Both runs must produce the same tokens; the script checks it.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import random_llama_20m, stories_path

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(
    vocab: int, requests: int, system_prompts: int, system_len: int, own_len: int, max_tokens: int
) -> Workload:
    rng = random.Random(0)
    systems = [[1] + [rng.randrange(3, vocab) for _ in range(system_len - 1)] for _ in range(system_prompts)]
    prompts = [
        systems[i % system_prompts]
        + [rng.randrange(3, vocab) for _ in range(rng.randrange(own_len // 2, own_len))]
        for i in range(requests)
    ]
    return Workload(prompts, max_tokens)


@dataclass(frozen=True)
class RunResult:
    seconds: float
    output_tokens: int
    mean_ttft: float
    cached_tokens: int
    outputs: dict[str, list[int]]

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds


def run(
    folder: Path, work: Workload, prefix_caching: bool, max_num_seqs: int, budget: int, threads: int
) -> RunResult:
    longest = max(len(p) for p in work.prompts) + work.max_tokens
    per_request = -(-longest // BLOCK_SIZE)
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder), dtype="float32", num_threads=threads),
            cache=CacheConfig(
                block_size=BLOCK_SIZE,
                num_blocks=per_request * (max_num_seqs + 4),  # the batch, plus room for cached prefixes
                enable_prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_queued_requests=len(work.prompts),
            ),
        )
    )
    # Warm-up outside the timed region, on tokens no request shares.
    engine.add_request(
        GenerationRequest("warm-up", SamplingParams(max_tokens=4, temperature=0.0), token_ids=[1, 2, 2, 2])
    )
    while engine.has_work():
        engine.step()
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(work.prompts):
        engine.add_request(GenerationRequest(f"r{i}", params, token_ids=prompt))
    first_token_at: dict[str, float] = {}
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(work.prompts))}
    cached = 0
    while engine.has_work():
        for out in engine.step():
            if out.request_id not in first_token_at:
                first_token_at[out.request_id] = time.perf_counter() - start
            outputs[out.request_id].extend(out.token_ids)
            if out.finished:
                cached += out.usage.cached_tokens
    seconds = time.perf_counter() - start
    engine.check_integrity()
    return RunResult(
        seconds=seconds,
        output_tokens=sum(len(t) for t in outputs.values()),
        mean_ttft=sum(first_token_at.values()) / len(first_token_at),
        cached_tokens=cached,
        outputs=outputs,
    )


def describe(label: str, result: RunResult, work: Workload) -> str:
    return (
        f"  prefix caching {label}: {result.throughput:8,.0f} output tok/s, "
        f"mean TTFT {1000 * result.mean_ttft:7.1f} ms, "
        f"{result.cached_tokens:,} of {work.prompt_tokens:,} prompt tokens served from the cache "
        f"({result.seconds:.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["stories", "20m"], default="stories")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=None, help="default: 384 (stories), 1024 (20m)")
    parser.add_argument("--own-len", type=int, default=32, help="each request's own tokens (up to)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: the engine's choice)")
    args = parser.parse_args()
    if args.model == "stories":
        folder, vocab, system_len = stories_path(), 512, args.system_len or 384
    else:
        folder, vocab, system_len = random_llama_20m(), 32000, args.system_len or 1024
    work = make_workload(vocab, args.requests, args.system_prompts, system_len, args.own_len, args.max_tokens)
    print(
        f"{folder.name}: {args.requests} requests, "
        f"{args.system_prompts} system prompts of {system_len} tokens + up to {args.own_len} own tokens, "
        f"{args.max_tokens} output tokens each, "
        f"max_num_seqs {args.max_num_seqs}, step budget {args.max_num_batched_tokens} tokens"
    )
    off = run(folder, work, False, args.max_num_seqs, args.max_num_batched_tokens, args.threads)
    on = run(folder, work, True, args.max_num_seqs, args.max_num_batched_tokens, args.threads)
    print(f"  (torch threads: {torch.get_num_threads()})")
    print(describe("off", off, work))
    print(describe("on ", on, work))
    same = on.outputs == off.outputs
    print(
        f"  ratios (on / off): throughput {on.throughput / off.throughput:.2f}x, "
        f"mean TTFT {on.mean_ttft / off.mean_ttft:.2f}x "
        f"({off.mean_ttft / on.mean_ttft:.2f}x faster to first token); "
        f"identical outputs: {'yes' if same else 'NO'}"
    )
    if not same:
        raise SystemExit("prefix caching changed the greedy outputs")


if __name__ == "__main__":
    main()
