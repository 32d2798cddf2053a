"""LoRA adapters made with PEFT on the tiny random checkpoints (no download), and their merged references."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model: Path,
    folder: Path,
    *,
    targets: list[str] | None = None,
    r: int = 8,
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 1,
    magnitude: float = 0.5,
    **extra: object,
) -> Path:
    """Save a PEFT LoRA adapter of `model` with random A and B (PEFT starts B at zero: no delta)."""
    from peft import LoraConfig, get_peft_model

    base = _fresh(model)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ATTENTION + MLP,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
        **extra,
    )
    peft_model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(
                    torch.randn(param.shape, generator=generator) * magnitude / param.shape[-1] ** 0.5
                )
    peft_model.save_pretrained(folder)
    return folder


def load_merged(model: Path, adapter: Path) -> transformers.PreTrainedModel:
    """transformers' model of `model` with the adapter merged into its weights (the reference)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_fresh(model), adapter).merge_and_unload().eval()


def _fresh(model: Path) -> transformers.PreTrainedModel:
    """A new copy (PEFT modifies the model it wraps; load_hf's are shared)."""
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
