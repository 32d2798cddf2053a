"""Limits on structured-output specs (SamplingParams.structured), shared by the gateway, which refuses a
spec over them with a 400 before it reaches an engine, and the engine, which refuses the same specs with
INVALID_ARGUMENT; one constant so both sides always agree."""

from __future__ import annotations

# Longest json_schema, regex or grammar, and longest choice list (its strings' bytes summed), in UTF-8
# bytes. Grammar compilation grows with the spec; 128 KiB holds a large tool set's schema.
MAX_STRUCTURED_SPEC_BYTES = 128 * 1024
