"""Accuracy of the quantized KV caches (--kv-cache-dtype int8 | fp8), and of int8 weights with an int8
cache (--quantization int8 --kv-cache-dtype int8), against float32 weights and cache.

For stories260K (trained) and a random configuration of every architecture the tests build, on the
engine's default CPU ops: the perplexity of a held-out text (teacher-forced prompt logprobs, prefilled
in chunks so later chunks read the quantized keys of earlier ones), the greedy agreement of the first
64 tokens on 50 prompts (the mean share of each run that matches the float32 run before they first
differ, and how many runs match entirely), and the largest difference of a held-out token's logprob.
tests/engine/test_kv_cache_accuracy.py pins bounds on these figures.

    .venv/bin/python -m bench.kv_accuracy [--archs] [--cpu-kernels auto|torch|...]
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams

STORIES = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "stories260K"

# Held out: written for this measurement, not drawn from the model's training stories.
HELD_OUT = [
    "Tom had a small red boat. Every morning he took it to the pond near his house. One day the wind was "
    "very strong and the boat went far away from the edge. Tom was sad and began to cry. His sister Mia "
    "saw him and ran to help. She found a long stick and pulled the boat back to the shore. Tom smiled "
    "and gave her a big hug. They played with the boat together until the sun went down.",
    "There was a little cat named Sam. Sam liked to sleep in the warm sun by the window. One day he saw a "
    "bird outside and wanted to play. He jumped up, but the window was closed. Sam felt silly. Then the "
    "girl who lived in the house opened the door, and Sam ran into the garden. The bird flew to a tree "
    "and sang a happy song. Sam sat under the tree and listened.",
    "Ben and his mom went to the store to buy food. Ben saw a big box of cookies and asked if he could "
    "have it. His mom said they could share the cookies with his friends. At home Ben gave a cookie to "
    "each friend. Everyone was happy and said thank you. Ben learned that sharing makes a good day even "
    "better.",
]

OPENINGS = [
    "Once upon a time",
    "One day, a little boy",
    "Lily wanted to",
    "The sun was",
    "Tom and Sue",
    "There was a big dog",
    "Mom said",
    "The bird flew",
    "A little girl named",
    "In the park",
    "The cat was",
    "Max had a toy",
    "It was a rainy day",
    "The old man",
    "Anna liked to",
    "The frog jumped",
    "Every night",
    "The king had",
    "Sara found a",
    "The ball was",
    "Tim was sad because",
    "The tree was",
    "A small bunny",
    "Dad made a",
    "The fish swam",
    "Once there was a car",
    "Lucy saw a",
    "The boy ran",
    "At school",
    "The cake was",
    "Mia and her friend",
    "The sky was",
    "A big bear",
    "Jack wanted a",
    "The flower was",
    "One morning",
    "The duck said",
    "Ben liked his",
    "The house was",
    "A happy pig",
    "Grandma gave",
    "The moon",
    "Sam had a red",
    "The little star",
    "Kate went to",
    "The dog barked",
    "A tiny mouse",
    "The girl smiled",
    "Joe and his dad",
    "The train",
]


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    kv_cache_dtype: str
    weights: str  # --quantization: none or int8
    perplexity: float
    perplexity_ratio: float  # against the float32 cache
    agreement: float  # mean share of each greedy run matching float32's before the first difference
    identical_runs: int
    runs: int
    max_logprob_diff: float


@dataclass(frozen=True, slots=True)
class Measured:
    nll: float
    tokens: list[list[int]]
    logprobs: list[float]


# (weights, KV cache) measured against (none, auto): each quantized cache, then int8 weights with int8 KV
CONFIGS = (("none", "int8"), ("none", "fp8"), ("int8", "int8"))


def _engine(folder: Path, kv: str, cpu_kernels: str, max_len: int | None, weights: str = "none") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                path=str(folder),
                dtype="float32",
                cpu_kernels=cpu_kernels,
                max_model_len=max_len,
                quantization=weights,
            ),
            cache=CacheConfig(block_size=16, num_blocks=1024, kv_cache_dtype=kv),
            # 64-token chunks: later chunks of a passage attend over the cached (quantized) keys
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64),
        )
    )


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (ids, params) in requests.items():
        engine.add_request(GenerationRequest(rid, params, token_ids=ids))
    outputs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def measure(
    engine: LLMEngine, passages: list[list[int]], prompts: list[list[int]], new_tokens: int
) -> Measured:
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = {f"t{i}": (ids, scoring) for i, ids in enumerate(passages)}
    requests |= {f"g{i}": (ids, greedy) for i, ids in enumerate(prompts)}
    outputs = _run(engine, requests)
    logprobs = [lp.logprob for i in range(len(passages)) for lp in outputs[f"t{i}"][0].prompt_logprobs]
    tokens = [[t for out in outputs[f"g{i}"] for t in out.token_ids] for i in range(len(prompts))]
    engine.check_integrity()
    return Measured(-sum(logprobs) / len(logprobs), tokens, logprobs)


def compare(model: str, weights: str, kv: str, ref: Measured, got: Measured) -> Row:
    def common_prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

    shares = [common_prefix(r, g) / len(r) for r, g in zip(ref.tokens, got.tokens, strict=True)]
    return Row(
        model=model,
        kv_cache_dtype=kv,
        weights=weights,
        perplexity=math.exp(got.nll),
        perplexity_ratio=math.exp(got.nll - ref.nll),
        agreement=sum(shares) / len(shares),
        identical_runs=sum(s == 1.0 for s in shares),
        runs=len(shares),
        max_logprob_diff=max(abs(a - b) for a, b in zip(ref.logprobs, got.logprobs, strict=True)),
    )


def stories_rows(cpu_kernels: str = "auto", configs: tuple[tuple[str, str], ...] = CONFIGS) -> list[Row]:
    reference = _engine(STORIES, "auto", cpu_kernels, None)
    encode = reference.tokenizer.hf.encode
    passages = [encode(text).ids for text in HELD_OUT]
    prompts = [encode(text).ids for text in OPENINGS]
    ref = measure(reference, passages, prompts, 64)
    return [
        compare(
            "stories260K",
            weights,
            kv,
            ref,
            measure(_engine(STORIES, kv, cpu_kernels, None, weights), passages, prompts, 64),
        )
        for weights, kv in configs
    ]


def arch_rows(cpu_kernels: str = "auto", configs: tuple[tuple[str, str], ...] = CONFIGS) -> list[Row]:
    """Random configurations of every architecture (tests/engine/test_architectures.py): 10 prompts of 6
    random tokens, 32 greedy tokens; 24 random passages of 40 tokens (within the smallest context, 48).
    A random model's near-flat logits move its perplexity by a few percent either way on a short text
    (4 passages gave -2.3%..+4.1% for fp8), so the mean over 936 tokens is the figure to compare."""
    from tests.engine.support.model_factory import make_tiny_model
    from tests.engine.test_architectures import ARCHS

    rng = random.Random(31)
    passages = [[1] + [rng.randrange(3, 259) for _ in range(39)] for _ in range(24)]
    prompts = [[1] + [rng.randrange(3, 259) for _ in range(5)] for _ in range(10)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in sorted(ARCHS.items()):
            folder = make_tiny_model(Path(tmp) / name, **spec)
            ref = measure(_engine(folder, "auto", cpu_kernels, 48), passages, prompts, 32)
            for weights, kv in configs:
                got = measure(_engine(folder, kv, cpu_kernels, 48, weights), passages, prompts, 32)
                rows.append(compare(name, weights, kv, ref, got))
    return rows


def format_rows(rows: list[Row]) -> str:
    lines = [
        "| model | weights | KV cache | perplexity | vs float32 | greedy agreement | identical runs "
        "| max logprob diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.weights} | {r.kv_cache_dtype} | {r.perplexity:.4f} "
            f"| {100 * (r.perplexity_ratio - 1):+.3f}% | "
            f"{100 * r.agreement:.1f}% | {r.identical_runs}/{r.runs} | {r.max_logprob_diff:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", action="store_true", help="also every architecture's random configuration")
    parser.add_argument("--cpu-kernels", default="auto")
    args = parser.parse_args()
    rows = stories_rows(args.cpu_kernels)
    if args.archs:
        rows += arch_rows(args.cpu_kernels)
    print(format_rows(rows))


if __name__ == "__main__":
    main()
