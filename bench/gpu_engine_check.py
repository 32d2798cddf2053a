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


def make_random_llama_1b(stories: Path, folder: Path) -> Path:
    """A random Llama of ~1B parameters with stories260K's 512-token tokenizer (so every id decodes)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
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
    print(f"random Llama: {params / 1e9:.2f} B parameters in {folder}")
    return folder


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


def throughput(folder: Path) -> dict:
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
            print(f"decode, 1B random Llama bf16, {key}: {rate:,.0f} tokens/s ({seconds:.2f} s)")
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
    args = parser.parse_args()
    stories = find_stories(args.stories)
    report = {"parity": [parity("stories260K", stories, 62)], "structured": structured_parity(stories)}
    report["workers"] = workers_parity(stories, 62)
    with tempfile.TemporaryDirectory() as tmp:
        big = make_random_llama_1b(stories, Path(tmp))
        report["parity"].append(parity("random-llama-1B", big, 12))
        report["decode_tokens_per_s"] = throughput(big)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
