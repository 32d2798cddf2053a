"""Which Hugging Face architectures this engine serves, and the ArchConfig of a model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conduit_engine.errors import ModelLoadError
from conduit_engine.models.base import CausalLM
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.gemma2 import Gemma2ForCausalLM
from conduit_engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from conduit_engine.models.phi3 import Phi3ForCausalLM
from conduit_engine.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    return ARCHITECTURES[architecture]


def arch_config(cfg: dict[str, Any]) -> ArchConfig:
    """Parse config.json's content; an unknown architecture is a ModelLoadError listing the supported."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}: "
            f"supported are {', '.join(ARCHITECTURES)}"
        )
    try:
        flags = ARCHITECTURES[arch].config_flags(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc
    return ArchConfig.from_dict(cfg, arch, flags)


def read_arch_config(folder: Path) -> ArchConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        return arch_config(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}") from exc
