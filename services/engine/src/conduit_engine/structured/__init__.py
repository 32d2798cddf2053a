"""Structured outputs: constrain a sequence's tokens to a JSON schema, regex, choice list or grammar.

Modules, each with one job:
- `spec`: what a request asks for (`StructuredSpec`), validated, with its compile cache key. Plain
  Python; the only module imported here, so `SamplingParams` can hold a spec without loading the
  grammar backend.
- `after_gate`: when the constraint starts (after a text such as `</think>` has appeared).
- `vocabulary`: the grammar backend's view of the model's tokenizer (`GrammarVocab`).
- `backend`: the one place xgrammar is chosen and its errors are read; the reasons for the choice.
- `schema_support`: the JSON Schema keywords the backend does not enforce (such schemas are refused).
- `compiler`: compiles specs on a worker thread, cached by spec (`StructuredCompiler`).
- `state`: one sequence's progress through its compiled structure (`GrammarState`).
- `batch_mask`: fills one int32 token bitmask for the constrained rows of a step (`BitmaskBuilder`).
The sampler applies that bitmask with `sampling.grammar_mask.apply_grammar_mask`.
"""

from __future__ import annotations

from conduit_engine.structured.spec import StructuredKind, StructuredSpec

__all__ = ["StructuredKind", "StructuredSpec"]
