"""One request's structured-output constraint (`StructuredSpec`): validated, hashable, with a cache key.

Plain Python: no torch and no grammar backend, so `SamplingParams` and the engine core can hold it.
Errors are `InvalidRequestError` naming the proto field (`sampling.json_schema`, `sampling.choice`, ...).

Size limit: the schema, regex or grammar text, or all choices together, may take at most
`MAX_SPEC_BYTES` of UTF-8: `conduit_common.structured.MAX_STRUCTURED_SPEC_BYTES` (128 KiB), the one
constant the gateway checks too, so a spec the gateway lets through is never refused here for its size.
Compile time and memory grow with the grammar, and compiling happens in the engine process, so an
unbounded spec would let one request stall every other request's grammar.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass

from conduit_common.structured import MAX_STRUCTURED_SPEC_BYTES
from conduit_engine.errors import InvalidRequestError

MAX_SPEC_BYTES = MAX_STRUCTURED_SPEC_BYTES
MAX_CHOICES = 1024
MAX_AFTER_BYTES = 256  # a reasoning end tag such as `</think>`, not a document


class StructuredKind(enum.Enum):
    """The member of the proto's `structured` oneof; the value is the proto field name."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"

    @property
    def is_json(self) -> bool:
        return self in (StructuredKind.JSON_SCHEMA, StructuredKind.JSON_OBJECT)


# Kinds whose constraint is the `text` field (the others use `choices` or nothing).
_TEXT_KINDS = (StructuredKind.JSON_SCHEMA, StructuredKind.REGEX, StructuredKind.GRAMMAR)


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What the output must be.

    kind: which constraint; text: the JSON schema, regex or EBNF grammar (empty for json_object and
    choice); choices: the allowed strings (choice only); any_whitespace: JSON kinds only, allow any
    whitespace between tokens (default: one space after `,` and `:`, no newlines); after: the
    constraint starts once this text has appeared in the output (None: from the first token).
    """

    kind: StructuredKind
    text: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = False
    after: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.choices, tuple):  # accept any sequence; keep the dataclass hashable
            object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind in _TEXT_KINDS:
            self._check_text()
        elif self.kind is StructuredKind.CHOICE:
            self._check_choices()
        _check(
            self.kind in _TEXT_KINDS or not self.text,
            self.field,
            "takes no text",
        )
        _check(
            self.kind is StructuredKind.CHOICE or not self.choices,
            self.field,
            "takes no choices",
        )
        if self.after is not None:
            size = len(self.after.encode())
            _check(size > 0, "sampling.structured_after", "must not be empty")
            _check(
                size <= MAX_AFTER_BYTES,
                "sampling.structured_after",
                f"at most {MAX_AFTER_BYTES} bytes, got {size}",
            )

    @property
    def field(self) -> str:
        """The request field this constraint came from, for error messages."""
        return f"sampling.{self.kind.value}"

    @property
    def cache_key(self) -> str:
        """Equal for specs that compile to the same grammar. `after` is left out: it gates when the
        grammar starts, per sequence, and does not change the grammar; so is whitespace for kinds
        other than JSON, which it does not affect."""
        whitespace = self.any_whitespace if self.kind.is_json else False
        canonical = json.dumps([self.kind.value, self.text, list(self.choices), whitespace])
        return hashlib.sha256(canonical.encode()).hexdigest()

    def _check_text(self) -> None:
        _check(bool(self.text.strip()), self.field, "must not be empty")
        size = len(self.text.encode())
        _check(size <= MAX_SPEC_BYTES, self.field, f"at most {MAX_SPEC_BYTES} bytes, got {size}")
        if self.kind is StructuredKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(self.field, f"is not valid JSON: {exc}") from None
            _check(
                isinstance(schema, dict | bool),
                self.field,
                f"must be a JSON object (a schema), got {type(schema).__name__}",
            )

    def _check_choices(self) -> None:
        _check(bool(self.choices), self.field, "must list at least one string")
        _check(
            len(self.choices) <= MAX_CHOICES,
            self.field,
            f"at most {MAX_CHOICES} strings, got {len(self.choices)}",
        )
        for i, choice in enumerate(self.choices):
            _check(isinstance(choice, str) and bool(choice), self.field, f"string {i} is empty")
        size = sum(len(c.encode()) for c in self.choices)
        _check(size <= MAX_SPEC_BYTES, self.field, f"at most {MAX_SPEC_BYTES} bytes in all, got {size}")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)
