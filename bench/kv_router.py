"""KV-aware routing benchmark: multi-turn sessions over three engines whose caches cannot hold them all,
round_robin, least_load, prefix_affinity and kv_aware in one run.

    .venv/bin/python bench/kv_router.py [--model stories|20m|PATH] [--sessions 30] [--turns 7]
                                        [--concurrency 12] [--kv-cache-blocks 256] [--max-tokens 24]
                                        [--opening-sentences 4] [--repeats 1]
                                        [--queued-hold-fraction 0.5] [--router-temperature 0]

Each session is a conversation: its first prompt is a fresh opening (a unique id and `opening-sentences`
sentences: an agent's system prompt and task), and
every later turn sends the whole conversation so far (the previous prompt, the model's answer, one new
sentence), so a turn that lands on the engine holding the conversation finds all of it but the new part
cached. All sessions run at once, `concurrency` requests at a time, so turns of different sessions
interleave; the engines' KV caches (`kv-cache-blocks` each) hold far less than all sessions, so blocks
are evicted. Every strategy gets three fresh engines and the same sessions (greedy, so the same answers).

Prints per strategy: prefix-cache hit rate (cached prompt tokens / prompt tokens, from the responses'
usage), time to first token p50 / p90 (streamed), requests and tokens per second, and for kv_aware the
index's accuracy (Σ min(predicted, actual) / Σ max(predicted, actual) cached blocks, from /metrics).

`--model stories` (stories260K, the default) computes a prompt in about the time of one decode step, so a
cached prefix saves almost nothing and TTFT measures load balance alone. `--model 20m` (a random Llama,
hidden 384 × 6 layers, 32k vocabulary, made once under .models/) with `--opening-sentences 40` gives each
conversation several hundred tokens whose prefill costs real time, as an agent's long context does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.support

import httpx  # noqa: E402

from bench.common import random_llama_20m, stories_path  # noqa: E402
from tests.support.engine_fleet import EngineFleet  # noqa: E402
from tests.support.processes import start_gateway  # noqa: E402

MODEL_NAME = "bench"  # the engines serve the model under this name
STRATEGIES = ("round_robin", "least_load", "prefix_affinity", "kv_aware")
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


@dataclass
class RunResult:
    strategy: str
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    agreed_blocks: float = 0.0  # kv_aware's predictions (from /metrics)
    union_blocks: float = 0.0

    def add(self, other: RunResult) -> None:
        """Fold another run of the same strategy into this one."""
        self.seconds += other.seconds
        self.ttft += other.ttft
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.agreed_blocks += other.agreed_blocks
        self.union_blocks += other.union_blocks

    @property
    def accuracy(self) -> float | None:
        return self.agreed_blocks / self.union_blocks if self.union_blocks else None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    def ttft_ms(self, q: float) -> float:
        return 1000 * statistics.quantiles(self.ttft, n=100)[int(q * 100) - 1]


def sessions(count: int, turns: int, opening: int, seed: int) -> list[tuple[str, list[str]]]:
    """(opening, the new sentence of each later turn) per session."""
    rng = random.Random(seed)
    return [
        (
            uuid.UUID(int=rng.getrandbits(128)).hex
            + " "
            + " ".join(rng.choice(SENTENCES) for _ in range(opening)),
            [rng.choice(SENTENCES) for _ in range(turns - 1)],
        )
        for _ in range(count)
    ]


async def stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int, result: RunResult) -> str:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter() - started
                text += chunk["choices"][0].get("text", "")
            usage = chunk.get("usage")
            if usage:
                result.prompt_tokens += usage["prompt_tokens"]
                result.completion_tokens += usage["completion_tokens"]
                result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    result.ttft.append(first if first is not None else time.perf_counter() - started)
    return text


async def run_sessions(url: str, plan, concurrency: int, max_tokens: int, result: RunResult) -> None:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def session(opening: str, additions: list[str]) -> None:
            prompt = opening
            for turn in range(len(additions) + 1):
                async with semaphore:
                    answer = await stream_one(client, prompt, max_tokens, result)
                if turn < len(additions):
                    prompt = f"{prompt}{answer} {additions[turn]}"

        started = time.perf_counter()
        await asyncio.gather(*(session(opening, additions) for opening, additions in plan))
        result.seconds = time.perf_counter() - started


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_index(url: str, engines: int) -> None:
    for _ in range(200):
        text = httpx.get(f"{url}/metrics", timeout=10).text
        if metric_sum(text, "conduit_gateway_kv_index_current") == engines:
            return
        time.sleep(0.05)
    raise SystemExit("the gateway's KV index never became current")


def run(strategy: str, args: argparse.Namespace, plan) -> RunResult:
    engine_args = ("--max-num-seqs", str(args.max_num_seqs), "--kv-cache-blocks", str(args.kv_cache_blocks))
    engine_args += ("--served-model-name", MODEL_NAME)
    engine_args += ("--queued-hold-fraction", str(args.queued_hold_fraction))
    result = RunResult(strategy)
    with EngineFleet(args.model, 3, engine_args) as fleet:
        gateway_args = ("--routing", strategy, "--load-interval", "0.2", "--log-level", "warning")
        gateway_args += ("--kv-overlap-weight", str(args.kv_overlap_weight))
        gateway_args += ("--affinity-load-factor", str(args.affinity_load_factor))
        gateway_args += ("--router-temperature", str(args.router_temperature))
        with start_gateway(fleet.addresses, *gateway_args) as gateway:
            if strategy == "kv_aware":
                wait_index(gateway.url, 3)
            asyncio.run(run_sessions(gateway.url, plan, args.concurrency, args.max_tokens, result))
            if strategy == "kv_aware":
                text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
                name = "conduit_gateway_kv_prediction_blocks_total"
                union = metric_sum(text, name, kind="union")
                result.agreed_blocks, result.union_blocks = metric_sum(text, name, kind="agreed"), union
                predicted, actual = (
                    metric_sum(text, name, kind="predicted"),
                    metric_sum(text, name, kind="actual"),
                )
                print(f"  kv_aware blocks: predicted {predicted:.0f}, actual {actual:.0f}, union {union:.0f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stories", help="stories, 20m or a model folder")
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--kv-cache-blocks", type=int, default=256)
    parser.add_argument("--opening-sentences", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-overlap-weight", type=float, default=8.0)
    parser.add_argument("--affinity-load-factor", type=float, default=2.0)
    parser.add_argument("--router-temperature", type=float, default=0.0)
    parser.add_argument(
        "--queued-hold-fraction", type=float, default=0.5, help="the engines' (0: prefixes only touched)"
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every strategy, pooled")
    args = parser.parse_args()
    args.model = str(
        {"stories": stories_path, "20m": random_llama_20m}.get(args.model, lambda: Path(args.model))()
    )
    if not Path(args.model).is_dir():
        raise SystemExit(f"{args.model} is not a model folder")
    plan = sessions(args.sessions, args.turns, args.opening_sentences, args.seed)
    print(
        f"{Path(args.model).name}: 3 engines ({args.kv_cache_blocks} KV blocks of 16 tokens each, "
        f"{args.max_num_seqs} seqs, queued hold fraction {args.queued_hold_fraction}); "
        f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} requests at a time, "
        f"{args.max_tokens} tokens per answer"
    )
    print(
        f"{'strategy':16s} {'hit rate':>8s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'req/s':>7s} {'tok/s':>8s}"
        "  accuracy"
    )
    strategies = args.strategies.split(",")
    merged = {strategy: RunResult(strategy) for strategy in strategies}
    # Rounds of every strategy in turn: a busy spell of the machine falls on all of them alike.
    for _ in range(args.repeats):
        for strategy in strategies:
            merged[strategy].add(run(strategy, args, plan))
    results = list(merged.values())
    for result in results:
        requests = len(result.ttft)
        accuracy = f"{result.accuracy:.1%}" if result.accuracy is not None else "-"
        tokens = result.prompt_tokens + result.completion_tokens
        print(
            f"{result.strategy:16s} {result.hit_rate:8.1%} {result.ttft_ms(0.5):7.1f}ms "
            f"{result.ttft_ms(0.9):7.1f}ms "
            f"{requests / result.seconds:7.1f} {tokens / result.seconds:8.0f}"
            f"  {accuracy}"
        )
    best = {r.strategy: r for r in results}
    kv = best.get("kv_aware")
    for other in [name for name in best if name != "kv_aware" and kv is not None]:
        r = best[other]
        print(
            f"kv_aware / {other}: hit rate {kv.hit_rate / r.hit_rate if r.hit_rate else float('inf'):.2f}x, "
            f"TTFT p90 {kv.ttft_ms(0.9) / r.ttft_ms(0.9):.2f}x, throughput {r.seconds / kv.seconds:.2f}x"
        )


if __name__ == "__main__":
    main()
