"""RoPE scaling parameters from config.json (`rope_scaling`, or transformers 5's `rope_parameters`).

Supported types: default, linear, dynamic (NTK), yarn, longrope (Phi-3; "su" is its old name) and
llama3. `layers/rotary.py` turns them into the cos/sin table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conduit_engine.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ALIASES = {"su": "longrope"}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """`factor` 1 and rope_type "default" mean no scaling; each type reads only its own fields."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn, longrope: the context the model was pretrained with
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn, longrope: cos/sin multiplier (None: derived from factor, as transformers does)
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # longrope: per-frequency divisors within (short) and beyond (long) the original context
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def context_limit(self, max_position_embeddings: int) -> int:
        """The longest context the scaled positions cover (as vLLM derives it)."""
        if self.rope_type in ("linear", "dynamic"):
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return int(self.original_max_position_embeddings * self.factor)
        return max_position_embeddings


def parse_rope_scaling(cfg: dict[str, Any], head_dim: int) -> RopeScaling:
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}: supported are {', '.join(ROPE_TYPES)}"
        )
    partial = float(raw.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor {partial} is not supported: RoPE covers the whole head")
    if rope_type == "default":
        return RopeScaling()
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    original = int(
        raw.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos
    )
    try:
        if rope_type == "longrope":
            return _longrope(raw, head_dim, max_pos, original)
        factor = raw.get("factor")
        if factor is None and rope_type == "yarn":
            factor = max_pos / original
        common = dict(rope_type=rope_type, factor=float(factor), original_max_position_embeddings=original)
        if rope_type == "llama3":
            return RopeScaling(
                **common,  # type: ignore[arg-type]
                low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
                high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            )
        if rope_type == "yarn":
            return RopeScaling(
                **common,  # type: ignore[arg-type]
                beta_fast=float(raw.get("beta_fast") or 32.0),
                beta_slow=float(raw.get("beta_slow") or 1.0),
                truncate=bool(raw.get("truncate", True)),
                attention_factor=_optional_float(raw.get("attention_factor")),
                mscale=_optional_float(raw.get("mscale")),
                mscale_all_dim=_optional_float(raw.get("mscale_all_dim")),
            )
        return RopeScaling(**common)  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"rope_scaling ({rope_type}) has a missing or bad field: {exc}") from exc


def _longrope(raw: dict[str, Any], head_dim: int, max_pos: int, original: int) -> RopeScaling:
    short, long = tuple(map(float, raw["short_factor"])), tuple(map(float, raw["long_factor"]))
    if len(short) != head_dim // 2 or len(long) != head_dim // 2:
        raise ModelLoadError(
            f"rope_scaling (longrope): short_factor and long_factor need head_dim / 2 = {head_dim // 2} "
            f"entries, got {len(short)} and {len(long)}"
        )
    factor = raw.get("factor")
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor) if factor is not None else max_pos / original,
        original_max_position_embeddings=original,
        attention_factor=_optional_float(raw.get("attention_factor")),
        short_factor=short,
        long_factor=long,
    )


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]
