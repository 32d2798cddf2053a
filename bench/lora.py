"""LoRA throughput: a batch of 16 requests spread over 1, 4 and 8 adapters against the same batch on the
base model, on one engine, in one run (rounds interleaved, so other load on the machine hits every case).

    .venv/bin/python bench/lora.py [--model 20m|stories|110m] [--rank 16] [--rounds 3] [--new-tokens 64]
        [--cpu-kernels auto|torch] [--num-threads T]

Adapters are random, written in PEFT's format on every projection (q, k, v, o, gate, up, down) at
--rank. Also runs the base batch on an engine without --enable-lora (the compiled decoder path), the
figure the LoRA engine's base rows are measured against. Prints output tokens/s per case and its ratio to
the base model's on the LoRA engine. Goal: 8 adapters of rank 16 >= 0.8x the base model on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import random_llama_20m, random_llama_110m, stories_path
from safetensors.torch import save_file

from conduit_engine.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BATCH = 16


def write_adapter(model: Path, folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of `model` on every projection."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in MODULES:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) / rank**0.5 * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps({**config, "bias": "none"}))
    return folder


def make_engine(model: Path, adapters: dict[str, Path], rank: int, args) -> LLMEngine:
    lora = LoraConfig(
        enable_lora=bool(adapters),
        lora_modules=tuple((n, str(p)) for n, p in adapters.items()),
        max_loras=max(1, len(adapters)),
        max_lora_rank=rank,
    )
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(model), num_threads=args.num_threads, cpu_kernels=args.cpu_kernels),
            cache=CacheConfig(num_blocks=64 * BATCH, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=4096),
            lora=lora,
        )
    )


def run_batch(engine: LLMEngine, adapters: list[str | None], new_tokens: int, vocab: int) -> float:
    """Output tokens/s of BATCH requests, request i on adapters[i % len(adapters)]."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        prompt = [1] + [(37 * i + 11 * j) % (vocab - 3) + 3 for j in range(32)]
        lora = adapters[i % len(adapters)]
        engine.add_request(
            GenerationRequest(f"r{time.monotonic_ns()}-{i}", params, token_ids=prompt, lora=lora)
        )
    started, tokens = time.perf_counter(), 0
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["20m", "stories", "110m"], default="20m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cpu-kernels", default="auto")
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args()
    model = {"20m": random_llama_20m, "stories": stories_path, "110m": random_llama_110m}[args.model]()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"a{i}": write_adapter(model, Path(tmp) / f"a{i}", args.rank, i) for i in range(8)}
        lora_engine = make_engine(model, adapters, args.rank, args)
        plain_engine = make_engine(model, {}, args.rank, args)
        names = list(adapters)
        cases = {
            "base, engine without --enable-lora": (plain_engine, [None]),
            "base": (lora_engine, [None]),
            "1 adapter": (lora_engine, names[:1]),
            "4 adapters": (lora_engine, names[:4]),
            "8 adapters": (lora_engine, names[:8]),
        }
        for engine, which in cases.values():  # warm-up, untimed
            run_batch(engine, which, 4, vocab)
        results: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (engine, which) in cases.items():
                results[name].append(run_batch(engine, which, args.new_tokens, vocab))
    base = statistics.median(results["base"])
    print(
        f"model {args.model}, batch {BATCH}, rank {args.rank}, {args.new_tokens} new tokens, "
        f"{args.rounds} rounds"
    )
    print(f"ops: {lora_engine.executor.model.describe_ops()}")
    print("| case | output tok/s (median) | vs base on the LoRA engine |")
    print("|---|---|---|")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.0f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
