"""Routing benchmark: a prefix-heavy workload over three engine replicas, prefix_affinity against
round_robin in the same run.

    .venv/bin/python bench/router.py [--model PATH] [--groups 12] [--per-group 8] [--concurrency 12]
                                     [--kv-cache-blocks 160] [--rounds 1]

Each of `groups` long shared prefixes (a system prompt, a document) is followed by `per-group` different
questions; the requests are shuffled and sent through the gateway `concurrency` at a time. Every run starts
three fresh engines, so no cache survives from the other strategy. The KV cache is sized so that one
engine can hold about a third of the prefixes: round robin makes every engine see every prefix, prefix
affinity gives each engine its own share. Prints, per strategy, the prefix-cache hit rate (cached prompt
tokens / prompt tokens, from the responses' usage), requests and tokens per second, and how the requests
spread over the engines; then the throughput ratio prefix_affinity / round_robin.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import httpx  # noqa: E402

from tests.support.engine_fleet import EngineFleet  # noqa: E402
from tests.support.processes import start_gateway  # noqa: E402

MODEL = "stories260K"
SENTENCES = (
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her friends.",
    "One day, she saw a big, red ball under a tall green tree.",
    "Her mom said that sharing is good and kind.",
    "The dog ran after the cat, and they all laughed together.",
    "Tom had a small boat that he liked to push in the water.",
    "The sun was warm and the birds sang happy songs.",
    "They went home and ate soup with bread for dinner.",
)
QUESTIONS = ("Then", "But", "After that", "Suddenly", "Later", "So", "When", "At night", "Soon", "Also")


@dataclass
class RunResult:
    strategy: str
    seconds: float
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    per_engine: list[int]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.completion_tokens) / self.seconds


def workload(groups: int, per_group: int, seed: int) -> list[str]:
    """Shuffled prompts: `groups` fresh prefixes of about 200 tokens, each with `per_group` endings."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        # A unique opening: no engine has this prefix cached from an earlier run.
        prefix = uuid.uuid4().hex + " " + " ".join(rng.choice(SENTENCES) for _ in range(14))
        for question in rng.sample(QUESTIONS, per_group):
            prompts.append(f"{prefix} {question} the {rng.choice(['dog', 'girl', 'boy', 'bird'])} said")
    rng.shuffle(prompts)
    return prompts


async def send_all(
    url: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[float, list[dict]]:
    semaphore = asyncio.Semaphore(concurrency)
    usages: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt: str) -> None:
            async with semaphore:
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                usages.append(response.json()["usage"])

        started = time.perf_counter()
        await asyncio.gather(*(one(prompt) for prompt in prompts))
        return time.perf_counter() - started, usages


def run(strategy: str, args: argparse.Namespace, prompts: list[str]) -> RunResult:
    engine_args = ("--max-num-seqs", "8", "--kv-cache-blocks", str(args.kv_cache_blocks))
    with EngineFleet(args.model, 3, engine_args) as fleet:
        before = fleet.finished()
        gateway_args = ("--routing", strategy, "--affinity-load-factor", str(args.affinity_load_factor))
        with start_gateway(fleet.addresses, *gateway_args, "--log-level", "warning") as gateway:
            seconds, usages = asyncio.run(send_all(gateway.url, prompts, args.concurrency, args.max_tokens))
        per_engine = [after - b for after, b in zip(fleet.finished(), before, strict=True)]
    return RunResult(
        strategy=strategy,
        seconds=seconds,
        requests=len(usages),
        prompt_tokens=sum(u["prompt_tokens"] for u in usages),
        cached_tokens=sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages),
        completion_tokens=sum(u["completion_tokens"] for u in usages),
        per_engine=per_engine,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-blocks", type=int, default=160)
    parser.add_argument("--affinity-load-factor", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.per_group > len(QUESTIONS):
        parser.error(f"--per-group: at most {len(QUESTIONS)}")
    if not Path(args.model).is_dir():
        raise SystemExit(f"{args.model} is missing: ../shared must sit beside the checkout")

    print(
        f"3 engines ({args.kv_cache_blocks} KV blocks each); {args.groups} prefixes x {args.per_group} "
        f"requests, {args.concurrency} concurrent, {args.max_tokens} tokens each"
    )
    best: dict[str, RunResult] = {}
    for round_index in range(args.rounds):
        # Alternate the order so drift on a shared machine hits both strategies.
        order = (
            ["round_robin", "prefix_affinity"] if round_index % 2 == 0 else ["prefix_affinity", "round_robin"]
        )
        for strategy in order:
            prompts = workload(args.groups, args.per_group, args.seed + round_index)
            result = run(strategy, args, prompts)
            print(
                f"  round {round_index + 1} {strategy:16s} hit rate {result.hit_rate:6.1%}  "
                f"{result.requests_per_s:7.1f} req/s  {result.tokens_per_s:8.0f} tok/s (prompt + output)  "
                f"per engine {result.per_engine}"
            )
            if strategy not in best or result.seconds < best[strategy].seconds:
                best[strategy] = result
    affinity, robin = best["prefix_affinity"], best["round_robin"]
    print(
        f"prefix-cache hit rate   round_robin {robin.hit_rate:.1%}   prefix_affinity {affinity.hit_rate:.1%}"
    )
    ratio = affinity.requests_per_s / robin.requests_per_s
    print(f"throughput ratio prefix_affinity / round_robin  {ratio:.3f}")


if __name__ == "__main__":
    main()
