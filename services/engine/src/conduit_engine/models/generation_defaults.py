"""What a model's generation_config.json contributes, per `--generation-config`.

- auto: its EOS ids end generation, and its sampling defaults (MODEL_DEFAULTABLE: temperature, top_p,
  top_k, min_p, repetition_penalty) and max_new_tokens apply where a request does not set them.
- vllm: its EOS ids only; requests default to the engine's own (OpenAI/vLLM) values. vLLM's flag of
  that name ignores the file's EOS ids too; stopping at the model's end-of-turn token is kept here
  because it describes the model, not a sampling taste.
- none: the file is not read.

`do_sample` is ignored, as vLLM ignores it: a default temperature applies as given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conduit_engine.errors import InvalidRequestError, ModelLoadError
from conduit_engine.sampling_params import MODEL_DEFAULTABLE, SamplingParams

FILE = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float | int] = field(default_factory=dict)  # MODEL_DEFAULTABLE fields only
    max_tokens: int | None = None  # from max_new_tokens; admission caps it to the context left

    @property
    def described(self) -> str:
        parts = [f"{k}={v}" for k, v in self.sampling.items()]
        if self.max_tokens is not None:
            parts.append(f"max_tokens={self.max_tokens}")
        return ", ".join(parts) or "none"


def read_generation_defaults(folder: Path, mode: str) -> GenerationDefaults:
    path = folder / FILE
    if mode == "none" or not path.is_file():
        return GenerationDefaults()
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            f"{path}: invalid JSON: {exc} (--generation-config none ignores the file)"
        ) from exc
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    if mode == "vllm":
        return GenerationDefaults(eos_ids)
    sampling = {name: raw[name] for name in MODEL_DEFAULTABLE if raw.get(name) is not None}
    max_new = raw.get("max_new_tokens")
    try:
        SamplingParams(**sampling, max_tokens=max_new)  # validates every default like a request
    except (InvalidRequestError, TypeError) as exc:
        raise ModelLoadError(
            f"{path}: bad default {exc} (--generation-config vllm ignores the file's sampling defaults)"
        ) from exc
    return GenerationDefaults(eos_ids, sampling, None if max_new is None else int(max_new))
