"""Architecture hyper-parameters read from a Hugging Face config.json, validated, one place per field.

The fields every decoder shares are read here; what differs between architectures (biases, q/k norms,
sliding windows, soft-capping, norm placement) comes from the architecture's model class
(`models/registry.py`) as plain flags, so the shared layers never branch on a model name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conduit_engine.errors import ModelLoadError
from conduit_engine.models.rope_config import RopeScaling, parse_rope_scaling

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    # Per layer: how many keys a query sees (itself included), or None for full attention.
    layer_windows: tuple[int | None, ...]
    hidden_act: str = "silu"  # silu | gelu_tanh: the gate activation of the gated MLP
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    attention_scale: float | None = None  # None → head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores → cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None  # the same on the output logits
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight) (Gemma: 1)
    sandwich_norms: bool = False  # a norm after attention and around the MLP (Gemma 2)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], architecture: str, flags: dict[str, Any]) -> ArchConfig:
        """The shared fields of `cfg`, then the architecture's `flags` (which may override them)."""
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            attention_bias = bool(cfg.get("attention_bias", False))
            fields: dict[str, Any] = dict(
                architecture=architecture,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=parse_rope_scaling(cfg, head_dim),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=attention_bias,
                o_bias=attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                layer_windows=(None,) * num_layers,
                hidden_act=activation(cfg.get("hidden_act", "silu")),
            )
            fields.update(flags)
            config = cls(**fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc
        config._validate()
        return config

    @property
    def uniform_window(self) -> int | None:
        """The sliding window when every layer has the same one (then old KV blocks can be freed)."""
        windows = set(self.layer_windows)
        if len(windows) == 1 and None not in windows:
            return next(iter(windows))
        return None

    @property
    def context_limit(self) -> int:
        """The longest context the model supports: its positions, stretched by the RoPE scaling."""
        return self.rope_scaling.context_limit(self.max_position_embeddings)

    def _validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if len(self.layer_windows) != self.num_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ModelLoadError(f"sliding_window must be >= 1, got {self.layer_windows}")


def activation(name: object) -> str:
    if name not in ACTIVATIONS:
        raise ModelLoadError(f"unsupported activation {name!r}: supported are {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]  # type: ignore[index]


def layer_windows(cfg: dict[str, Any], default_sliding: list[bool]) -> tuple[int | None, ...]:
    """Per-layer windows: config.json's `layer_types` when present (transformers 5 writes it), else
    `default_sliding` (which layers the architecture makes sliding when the file predates layer_types)."""
    window = cfg.get("sliding_window")
    if window is None:
        return (None,) * len(default_sliding)
    types = cfg.get("layer_types")
    if types is None:
        sliding = default_sliding
    else:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ModelLoadError(
                f"unsupported layer_types {unknown}: supported are sliding_attention, full_attention"
            )
        sliding = [t == "sliding_attention" for t in types]
    return tuple(int(window) if s else None for s in sliding)
