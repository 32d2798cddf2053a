"""The grammar backend: xgrammar 0.2.8, imported here only, and how its error messages are read.

Why xgrammar and not llguidance 1.9.1 (both measured in this repository's virtualenv, 2 shared CPU
cores, on the stories260K tokenizer (512 tokens) and the Llama 2 tokenizer (32,000 tokens)):
- Correctness on our tokenizer: with llguidance, a JSON schema with fixed separators (`": "`) on the
  512-token SentencePiece vocabulary yields a mask after `:` that allows digits but not the space token,
  and consuming the allowed digit puts the matcher into its error state: masked greedy decoding of
  `{"age": 7}` cannot proceed. xgrammar's masks agree with its own matcher on both vocabularies.
- Mask speed (fill + accept per token, driving one JSON document with a string pattern, `$ref` and
  `anyOf`): xgrammar 1.6 µs (512) / 9.1 µs (32k); llguidance 26 µs / 55 µs. Compile: xgrammar 1 ms /
  5 ms for that schema, 156 ms for a 40-property schema with patterns on 32k, with the GIL released
  (the step thread keeps running); llguidance builds lazily (1 ms) and pays at mask time instead.
- JSON Schema coverage: both handle `$ref` (also recursive), `anyOf`, `allOf`, `pattern`, `format`,
  `enum`, array bounds and number ranges. Whitespace: xgrammar's `any_whitespace=False` is exactly what
  vLLM's `disable_any_whitespace` selects (one space after `,` and `:`, no newlines).
- Errors: both name the problem ("Unsupported type \"objectx\"", "Cannot find field $defs in
  #/$defs/nope", "Regex parsing error at position 4: The parenthesis is not closed.", EBNF line and
  column). xgrammar prefixes a C++ source location, which `reason()` strips.
- Thread safety: xgrammar's compiler may be called from any thread; a matcher belongs to one sequence
  and is used only by the step thread. llguidance matchers are likewise per sequence.
- Grammar dialect: the proto documents xgrammar's EBNF (GBNF-like, `root ::= ...`).
- Cost, where llguidance wins: it is one 7.6 MB wheel with no dependencies. xgrammar is 3.8 MB plus
  apache-tvm-ffi (13 MB), imports transformers at import time (the engine now depends on it), and
  declares triton (GPU kernels this engine does not use), so the development virtualenv installs
  xgrammar with --no-deps plus its real dependencies, pinned (requirements-nodeps.txt, Makefile).
"""

from __future__ import annotations

import re

import xgrammar

__all__ = ["reason", "xgrammar"]

# "[23:51:57] /project/cpp/json_schema_converter.cc:4944: " and "Check failed: (error.empty()) is false: "
_LOCATION = re.compile(r"^\[[0-9:.]+\]\s+\S+:\d+:\s*")
_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")
MAX_REASON_CHARS = 300  # xgrammar may echo the whole schema back; the client sent it, keep errors short


def reason(exc: BaseException) -> str:
    """The backend's explanation of a failure, without its C++ source location, on one line."""
    text = str(exc).strip()
    text = _CHECK.sub("", _LOCATION.sub("", text))
    text = " ".join(text.split())
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS - 1] + "…"
    return text or type(exc).__name__
