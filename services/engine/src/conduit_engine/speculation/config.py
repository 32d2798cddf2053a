"""`--speculative-config`: vLLM's JSON shape, checked field by field at start-up.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "PATH|HUB_ID", "num_speculative_tokens": 4}

Conduit's own optional fields: `min_acceptance_rate` (default 0.25: a sequence whose moving acceptance
rate falls under it stops speculating for a while, and a step speculates only while speculating has
measured cheaper per emitted token than not, speculation/gate.py; 0 turns both off: every proposal is
verified) and `acceptance_window` (how many recent proposals that rate averages over, roughly). Every
error names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
FLAG = "--speculative-config"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: the draft's folder or Hub id
    min_acceptance_rate: float = 0.25
    acceptance_window: int = 8

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        _check(1 <= k <= 16, "num_speculative_tokens", f"must be an integer from 1 to 16, got {k}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            _check(lo >= 1, "prompt_lookup_min", f"must be >= 1, got {lo}")
            _check(hi >= lo, "prompt_lookup_max", f"must be >= prompt_lookup_min ({lo}), got {hi}")
            _check(hi <= 64, "prompt_lookup_max", f"must be <= 64, got {hi}")
            _check(self.model is None, "model", "is for method draft_model, not ngram")
        else:
            _check(bool(self.model), "model", "method draft_model needs the draft model (a folder or Hub id)")
        rate = self.min_acceptance_rate
        _check(0.0 <= rate < 1.0, "min_acceptance_rate", f"must be in [0, 1), got {rate}")
        _check(
            self.acceptance_window >= 1, "acceptance_window", f"must be >= 1, got {self.acceptance_window}"
        )


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "method": str,
    "num_speculative_tokens": int,
    "prompt_lookup_min": int,
    "prompt_lookup_max": int,
    "model": str,
    "min_acceptance_rate": (int, float),
    "acceptance_window": int,
}


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The configuration of `text` (None or empty: speculation off). Raises ValueError naming the field."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{FLAG}: not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG}: must be a JSON object, got {type(raw).__name__}")
    return speculative_config_from_dict(raw)


def speculative_config_from_dict(raw: dict[str, Any]) -> SpeculativeConfig:
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{FLAG}: unknown field {unknown[0]!r} (known: {', '.join(_FIELDS)})")
    for name in ("method", "num_speculative_tokens"):
        _check(name in raw, name, "is required")
    for name, value in raw.items():
        kind = _FIELDS[name]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        expected = {str: "a string", int: "an integer"}.get(kind, "a number")  # type: ignore[call-overload]
        _check(ok, name, f"must be {expected}, got {json.dumps(value)}")
    if raw["method"] == "ngram" and "prompt_lookup_min" in raw and "prompt_lookup_max" not in raw:
        raw = {**raw, "prompt_lookup_max": max(raw["prompt_lookup_min"], 4)}
    return SpeculativeConfig(**{k: (float(v) if k == "min_acceptance_rate" else v) for k, v in raw.items()})


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{FLAG}: {field} {message}")
