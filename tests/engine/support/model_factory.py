"""Tiny random Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2) written to disk
for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from conduit_engine.models.demo_model import CHAT_TEMPLATE, byte_tokenizer

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
}


def make_tiny_model(
    folder: Path,
    family: str = "llama",
    *,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    num_layers: int = 2,
    intermediate_size: int = 96,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    norm_noise: float = 0.0,
    max_position_embeddings: int = 512,
    **extra: object,
) -> Path:
    """Save a random model with the byte-level demo tokenizer; logits are peaked enough for stable argmax.

    norm_noise: add N(0, norm_noise) to every norm weight, so that norms initialised to a constant (all
    of them, in transformers) still test that the right weight reaches the right place."""
    tok = byte_tokenizer()
    config_cls, model_cls = FAMILIES[family]
    kwargs: dict[str, object] = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.3,
        **extra,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config)
    if norm_noise:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * norm_noise)
    model = model.to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def hf_greedy(
    folder: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> list[int]:
    """Reference: greedy decoding with transformers, recomputing the whole sequence each step."""
    model = load_hf(folder, dtype)
    return greedy_with(model, prompt, max_new_tokens)


_HF_CACHE: dict[tuple[str, torch.dtype], transformers.PreTrainedModel] = {}


def load_hf(folder: Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    key = (str(folder), dtype)
    if key not in _HF_CACHE:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        _HF_CACHE[key] = model.eval()
    return _HF_CACHE[key]


@torch.inference_mode()
def greedy_with(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    past = None
    step_input = ids
    for _ in range(max_new_tokens):
        result = model(input_ids=step_input, past_key_values=past, use_cache=True)
        past = result.past_key_values
        token = int(result.logits[0, -1].float().argmax())
        out.append(token)
        step_input = torch.tensor([[token]])
    return out
