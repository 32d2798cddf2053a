"""Sampling and stopping parameters of one request, with OpenAI/vLLM defaults and validation.

Plain Python: no torch. Every check raises InvalidRequestError naming the field.

A request built from the wire (`from_request`) remembers which of `MODEL_DEFAULTABLE` it left unset, so
that admission can fill exactly those from the model's generation_config.json (`with_defaults`), once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from conduit_engine.errors import InvalidRequestError
from conduit_engine.structured.spec import StructuredSpec

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# The sampling fields a model's generation_config.json may give defaults for (as vLLM takes them).
MODEL_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(slots=True)
class SamplingParams:
    # None: not set; admission resolves it (16 for text and token ids, until the context is full for chat).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 on input) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: chosen token + k alternatives
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    structured: StructuredSpec | None = None  # output constraint, validated when built
    # Which MODEL_DEFAULTABLE fields the request left unset; built directly, every field counts as set.
    unset: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @classmethod
    def from_request(cls, **given: object) -> SamplingParams:
        """The parameters of a request that set exactly `given`; the other fields keep the defaults
        above and, among MODEL_DEFAULTABLE, are marked unset."""
        return cls(**given, unset=frozenset(MODEL_DEFAULTABLE) - given.keys())  # type: ignore[arg-type]

    def with_defaults(self, defaults: Mapping[str, float | int]) -> SamplingParams:
        """A copy whose unset fields take `defaults` (the model's); set fields keep the request's value."""
        chosen = {name: value for name, value in defaults.items() if name in self.unset}
        if not chosen:
            return self
        return dataclasses.replace(self, **chosen, unset=self.unset - chosen.keys())  # type: ignore[arg-type]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError for the first bad field; `vocab_size` enables token-id checks."""
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be at least 1, got {self.max_tokens}",
        )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(self.temperature == self.temperature, "temperature", "must be a number")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                name,
                f"must be in [0, {MAX_LOGPROBS}], got {value}",
            )
        _check(1 <= self.n <= 128, "n", f"must be in [1, 128], got {self.n}")
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        _check(all(self.stop), "stop", "stop strings must not be empty")
        for token_id, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"bias for token {token_id} must be in [-100, 100]")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
                bad = [i for i in ids if not 0 <= i < vocab_size]
                _check(not bad, name, f"token id {bad[:1]} outside the vocabulary [0, {vocab_size})")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)
