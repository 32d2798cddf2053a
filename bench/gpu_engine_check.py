"""The engine on CUDA against the engine on the CPU, and its decode speed (needs a CUDA device and CuPy).

- greedy parity: the same prompts, float32, --device cpu vs --device cuda, on stories260K and on a
  ~1B-parameter random Llama (hidden 2048, 22 layers, 32/4 heads, made here in a temp folder);
- decode tokens/s on the 1B model in bfloat16 at batch 1 and 64, with and without CUDA graphs;
- the model in a worker process (--worker-process, CUDA graphs captured there) and, with two GPUs or
  more, --tensor-parallel-size 2 (NCCL): the in-process CUDA engine's greedy tokens.

    python3 bench/gpu_engine_check.py [--stories PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def find_stories(explicit: str | None) -> Path:
    for path in (
        explicit,
        REPO.parent / "shared" / "models" / "stories260K",
        REPO / "build" / "gpu_carry" / "stories260K",
    ):
        if path and (Path(path) / "model.safetensors").is_file():
            return Path(path)
    raise SystemExit("stories260K not found: pass --stories or carry it as build/gpu_carry/stories260K")


# (hidden, intermediate, layers, heads, kv_heads): Llama-3.2-1B-like (22 layers as TinyLlama) and Llama-3-8B.
SHAPES = {"1B": (2048, 5632, 22, 32, 4), "8B": (4096, 14336, 32, 32, 8)}
BATCH64_BEFORE = 18685.0  # tokens/s of the 1B shape at batch 64 with graphs, the first H200 run


def make_random_llama(stories: Path, folder: Path, shape: str = "1B") -> tuple[Path, int]:
    """A random Llama of the given shape with stories260K's 512-token tokenizer (so every id decodes);
    returns its folder and its parameter count."""
    import transformers

    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for item in stories.iterdir():
        if item.name.startswith("tokenizer") or item.suffix == ".jinja":
            shutil.copy(item, folder / item.name)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    print(f"random Llama {shape}: {params / 1e9:.2f} B parameters in {folder}")
    return folder, params


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the weight-streaming ceiling)."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def engine(
    folder: Path,
    device: str,
    dtype: str,
    max_num_seqs: int,
    enforce_eager: bool,
    parallel: ParallelConfig = ParallelConfig(),
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder), device=device, dtype=dtype),
            cache=CacheConfig(num_blocks=max(512, max_num_seqs * 24)),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096),
            parallel=parallel,
            enforce_eager=enforce_eager,
        )
    )


def generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        eng.add_request(GenerationRequest(f"r{i}", params, token_ids=prompt))
    start = time.perf_counter()
    while eng.has_work():
        for out in eng.step():
            tokens[out.request_id].extend(out.token_ids)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [tokens[f"r{i}"] for i in range(len(prompts))], time.perf_counter() - start


def parity(name: str, folder: Path, max_tokens: int) -> dict:
    prompts = [[1], [1, 403, 407, 261, 378], [1, 65, 300, 12, 77, 401, 5]]
    cpu, _ = generate(engine(folder, "cpu", "float32", 4, True), prompts, max_tokens)
    result = {"model": name}
    for eager in (True, False):
        cuda, _ = generate(engine(folder, "cuda", "float32", 4, eager), prompts, max_tokens)
        mismatches = [
            (i, next((j for j, (a, b) in enumerate(zip(c, g, strict=True)) if a != b), None))
            for i, (c, g) in enumerate(zip(cpu, cuda, strict=True))
            if c != g
        ]
        result["eager" if eager else "graphs"] = (
            "equal" if not mismatches else f"differ (row, first index): {mismatches}"
        )
    print(
        f"greedy parity cpu vs cuda float32, {name}, {max_tokens} tokens x {len(prompts)} prompts: {result}"
    )
    return result


def throughput(folder: Path, label: str = "1B") -> dict:
    figures = {}
    for batch, max_tokens in ((1, 128), (64, 64)):
        prompts = [[1, 5 + i, 17, 300, 42, 7, 99, 250] for i in range(batch)]
        for eager in (True, False):
            eng = engine(folder, "cuda", "bfloat16", max(batch, 1), eager)
            generate(eng, prompts[:1], 8)  # warm-up: kernel compilation, graph capture
            out, seconds = generate(eng, prompts, max_tokens)
            rate = sum(len(t) for t in out) / seconds
            key = f"batch {batch}, {'eager' if eager else 'CUDA graphs'}"
            figures[key] = round(rate, 1)
            print(f"decode, {label} random Llama bf16, {key}: {rate:,.0f} tokens/s ({seconds:.2f} s)")
    return figures


def structured_parity(folder: Path) -> dict:
    """A JSON-schema request masked by the bitmask kernel on CUDA gives the CPU's greedy text."""
    from conduit_engine.structured.spec import StructuredKind, StructuredSpec

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    spec = StructuredSpec(kind=StructuredKind.JSON_SCHEMA, text=json.dumps(schema))
    texts = {}
    for device in ("cpu", "cuda"):
        eng = engine(folder, device, "float32", 4, True)
        params = SamplingParams(max_tokens=60, temperature=0.0, structured=spec)
        eng.add_request(GenerationRequest("s", params, token_ids=[1, 403, 407, 261, 378]))
        text = ""
        while eng.has_work():
            text += "".join(out.text for out in eng.step())
        texts[device] = text
    result = {"cpu": texts["cpu"], "cuda": texts["cuda"], "equal": texts["cpu"] == texts["cuda"]}
    print(f"structured output (JSON schema) cpu vs cuda: {result}")
    return result


def workers_parity(folder: Path, max_tokens: int) -> dict:
    """CUDA in process vs CUDA in worker processes (graphs captured in each worker)."""
    prompts = [[1], [1, 403, 407, 261, 378], [1, 65, 300, 12, 77, 401, 5]]
    reference, _ = generate(engine(folder, "cuda", "float32", 4, False), prompts, max_tokens)
    layouts = [ParallelConfig(1, True)] + ([ParallelConfig(2)] if torch.cuda.device_count() >= 2 else [])
    result = {}
    for parallel in layouts:
        eng = engine(folder, "cuda", "float32", 4, False, parallel)
        try:
            out, _ = generate(eng, prompts, max_tokens)
        finally:
            eng.shutdown()
        key = f"tp={parallel.tensor_parallel_size}, worker process"
        result[key] = "equal" if out == reference else f"differ: {out} vs {reference}"
    print(
        f"greedy parity, cuda in process vs workers, {max_tokens} tokens x {len(prompts)} prompts: {result}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stories")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument(
        "--with-8b", action="store_true", help="also decode an 8B-shape model (~16 GB, minutes)"
    )
    args = parser.parse_args()
    stories = find_stories(args.stories)
    report = {"parity": [parity("stories260K", stories, 62)], "structured": structured_parity(stories)}
    report["workers"] = workers_parity(stories, 62)
    ceiling = copy_bandwidth()
    print(f"device-to-device copy: {ceiling / 1e12:.2f} TB/s")
    goals = []
    with tempfile.TemporaryDirectory() as tmp:
        big, params = make_random_llama(stories, Path(tmp))
        report["parity"].append(parity("random-llama-1B", big, 12))
        report["decode_tokens_per_s"] = figures = throughput(big)
    one = figures["batch 1, CUDA graphs"] * 2 * params / ceiling  # weight bytes streamed per token
    goals.append(("1B batch 1, graphs", f"{one:.2f} of copy in weight bytes/s", ">= 0.50", one >= 0.5))
    many = figures["batch 64, CUDA graphs"] / BATCH64_BEFORE
    goals.append(
        ("1B batch 64, graphs", f"{many:.2f}x the first run's {BATCH64_BEFORE:,.0f}", ">= 1.50x", many >= 1.5)
    )
    if args.with_8b:
        with tempfile.TemporaryDirectory() as tmp:
            big, params = make_random_llama(stories, Path(tmp), "8B")
            report["decode_tokens_per_s_8b"] = figures = throughput(big, "8B")
        one = figures["batch 1, CUDA graphs"] * 2 * params / ceiling
        goals.append(("8B batch 1, graphs", f"{one:.2f} of copy in weight bytes/s", "reported", True))
    parity_ok = all(r.get(k) == "equal" for r in report["parity"] for k in ("eager", "graphs"))
    goals.append(
        ("greedy parity cpu vs cuda (eager, graphs)", "equal" if parity_ok else "DIFFER", "equal", parity_ok)
    )
    print("\n| figure | value | goal | met |\n|---|---|---|---|")
    for figure, value, goal, met in goals:
        print(f"| {figure} | {value} | {goal} | {'yes' if met else 'NO'} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
