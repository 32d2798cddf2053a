"""The one structured-output constraint of a request: found among `response_format`,
`structured_outputs` and the `guided_*` extras, checked, and set on SamplingParams.

A request takes one constraint; two (in any spelling) are a 400 naming both. Errors the engine reports
about the constraint (its field names: json_schema, regex, ..., or the whole `structured` oneof) are
named after the request field that set it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import invalid_param
from conduit_gateway.schemas.structured import StructuredOutputs, StructuredRequest
from conduit_gateway.structured import validation

# SamplingParams fields (and the oneof) an engine error may name, bare or as the engine's messages spell
# them (`sampling.regex: does not compile: ...`).
_SAMPLING_FIELDS = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "structured",
    "structured_any_whitespace",
    "structured_after",
)
_ENGINE_FIELDS = _SAMPLING_FIELDS + tuple(f"sampling.{name}" for name in _SAMPLING_FIELDS)


@dataclass(frozen=True, slots=True)
class Constraint:
    """`kind` is the SamplingParams.structured member; `param` the request field that set it."""

    param: str
    kind: str  # json_schema | json_object | regex | choice | grammar
    value: str | list[str] | None = None
    any_whitespace: bool | None = None

    def apply(self, params: engine_pb2.SamplingParams, after: str | None = None) -> None:
        """Set the constraint on `params`; `after` delays it until that text (a reasoning end tag)."""
        if self.kind == "json_object":
            params.json_object = True
        elif self.kind == "choice":
            params.choice.CopyFrom(engine_pb2.ChoiceList(choices=self.value))
        else:
            setattr(params, self.kind, self.value)
        if self.any_whitespace is not None:
            params.structured_any_whitespace = self.any_whitespace
        if after is not None:
            params.structured_after = after

    def aliases(self) -> dict[str, str]:
        """Engine field name → this request's field, for `param` in engine errors."""
        return dict.fromkeys(_ENGINE_FIELDS, self.param)


def request_constraint(body: StructuredRequest) -> Constraint | None:
    """The request's checked constraint, or None; a 400 for two constraints or a bad one."""
    if body.guided_whitespace_pattern is not None:
        raise invalid_param(
            "guided_whitespace_pattern", "is not supported; use structured_outputs.disable_any_whitespace"
        )
    found = list(_stated(body))
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise invalid_param(
            second, f"cannot be combined with {first}: a request takes one structured output constraint"
        )
    if not found:
        return None
    param, kind, value = found[0]
    compact = body.structured_outputs.disable_any_whitespace if body.structured_outputs else None
    any_whitespace = None if compact is None else not compact
    return Constraint(param, kind, _checked(param, kind, value), any_whitespace)


def _stated(body: StructuredRequest) -> Iterator[tuple[str, str, object]]:
    """(request field, constraint kind, raw value) for every constraint the request states."""
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        yield "response_format", "json_object", None
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None:
            raise invalid_param("response_format.json_schema", "is required when type is 'json_schema'")
        if spec.json_schema is None:
            raise invalid_param("response_format.json_schema.schema", "is required")
        yield "response_format.json_schema.schema", "json_schema", spec.json_schema
    outputs = body.structured_outputs or StructuredOutputs()
    for param, kind, value in (
        ("structured_outputs.json", "json_schema", outputs.json_value),
        ("structured_outputs.regex", "regex", outputs.regex),
        ("structured_outputs.choice", "choice", outputs.choice),
        ("structured_outputs.grammar", "grammar", outputs.grammar),
        ("structured_outputs.json_object", "json_object", outputs.json_object or None),
        ("guided_json", "json_schema", body.guided_json),
        ("guided_regex", "regex", body.guided_regex),
        ("guided_choice", "choice", body.guided_choice),
        ("guided_grammar", "grammar", body.guided_grammar),
    ):
        if value is not None:
            yield param, kind, value


def _checked(param: str, kind: str, value: object) -> str | list[str] | None:
    if kind == "json_schema":
        return validation.json_schema_text(param, value)  # type: ignore[arg-type]
    if kind == "regex":
        return validation.check_regex(param, value)  # type: ignore[arg-type]
    if kind == "choice":
        return validation.check_choice(param, value)  # type: ignore[arg-type]
    if kind == "grammar":
        return validation.check_grammar(param, value)  # type: ignore[arg-type]
    return None
