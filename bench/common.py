"""Shared pieces of the benchmarks: model folders, request sets, the transformers baseline."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))  # for tests.engine.support.model_factory


def stories_path() -> Path:
    path = SHARED / "models" / "stories260K"
    if not path.is_dir():
        raise SystemExit(f"{path} is missing: ../shared must sit beside the checkout")
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def random_llama_110m(cache_dir: Path = REPO / ".models" / "random-llama-110m") -> Path:
    """A random Llama with hidden 768 and 12 layers and a 32k vocabulary: 110M parameters with a tied
    head, 134M as made here (transformers' LlamaConfig unties it). It carries the Llama 2 tokenizer,
    tokenizer.model included (llama.cpp's GGUF converter reads SentencePiece vocabularies from it)."""
    tok_src = SHARED / "tokenizers" / "llama2"
    if (cache_dir / "model.safetensors").is_file():
        for name in TOKENIZER_FILES:  # folders made before tokenizer.model was copied
            if not (cache_dir / name).is_file():
                (cache_dir / name).write_bytes((tok_src / name).read_bytes())
        return cache_dir
    import transformers

    from conduit_engine.models.demo_model import CHAT_TEMPLATE

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    cache_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cache_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        (cache_dir / name).write_bytes((tok_src / name).read_bytes())
    (cache_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return cache_dir


def random_llama_20m(cache_dir: Path = REPO / ".models" / "random-llama-20m") -> Path:
    """A random Llama with hidden 384, 6 layers, a 32k vocabulary (tied) and a 2,048-token context."""
    if (cache_dir / "model.safetensors").is_file():
        return cache_dir
    import transformers

    from conduit_engine.models.demo_model import CHAT_TEMPLATE

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    cache_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(cache_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (cache_dir / name).write_bytes((SHARED / "tokenizers" / "llama2" / name).read_bytes())
    (cache_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return cache_dir


def request_set(
    n: int, vocab: int, seed: int = 0, prompt_range=(4, 64), output_range=(16, 128)
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(*prompt_range))],
            rng.randrange(*output_range),
        )
        for _ in range(n)
    ]


def hf_static_batches(folder: Path, requests, batch_size: int) -> tuple[int, float]:
    """transformers generate() in static batches (left padding, greedy, no EOS stop) → (tokens, seconds)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, start = 0, time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(m for _, m in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        total += sum(m for _, m in batch)  # tokens the requests asked for (padding work not counted)
    return total, time.perf_counter() - start
