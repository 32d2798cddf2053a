"""Architecture hyper-parameters read from a Hugging Face config.json, validated, one place per field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conduit_engine.errors import ModelLoadError

# Hugging Face architecture name → (our model family, has qkv bias by default)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("llama", True),
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type "llama3"); `factor` 1 means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: "
                f"supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _, default_qkv_bias = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
            scaling = cfg.get("rope_scaling") or (rope_params if "rope_type" in rope_params else None)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            attention_bias = bool(cfg.get("attention_bias", default_qkv_bias))
            config = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=_parse_rope_scaling(scaling),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=default_qkv_bias or attention_bias,
                o_bias=attention_bias and not default_qkv_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                sliding_window=_sliding_window(cfg),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc
        config._validate()
        return config

    @classmethod
    def from_folder(cls, folder: Path) -> ArchConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: invalid JSON: {exc}") from exc

    def _validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    if rope_type != "llama3":
        raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}: supported are default, llama3")
    return RopeScaling(
        rope_type="llama3",
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)
