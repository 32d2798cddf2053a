"""The byte bound on prompt text, derived from the tokenizer at load: a text that cannot fit the context is
refused before it is tokenized (tokenizing megabytes costs seconds and gigabytes).

No token covers more than L bytes of the normalized text, L being the longest vocabulary entry in UTF-8
(a byte-fallback token covers one byte, a byte-level token's text is longer than its bytes, an unknown
character is at most 4 bytes). The normalizer may only add text (Prepend, Replace by something as long)
or collapse runs of a few literal characters (`collapsed`, e.g. Llama's runs of spaces): so a text of
more than max_model_len × L bytes needs more than max_model_len tokens, except for what the normalizer
collapses. That text counts in full all the same: stories260K's normalizer (a regex for trailing spaces) is
quadratic in the length of a run of spaces (37 KB of them take 24 s), so text padded with megabytes of
collapsible spaces cannot be tokenized in bounded time either.

The bound is only claimed for tokenizers whose pipeline is known to behave so (Llama's SentencePiece
BPE, GPT-2's byte-level BPE and their kin); for any other (NFC/NFKC, whitespace-splitting pre-tokenizers,
WordPiece, fused unknown tokens, truncation) there is none (max_bytes 0) and the engine says so at load.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from conduit_common.prompt_size import over_bound, too_long_message
from conduit_engine.errors import InvalidRequestError

# What a Generate or Tokenize message may carry besides its prompt text: sampling parameters, stop
# strings, logit bias, response schemas, tool definitions.
REQUEST_HEADROOM_BYTES = 4 * 1024 * 1024
# A packed token id takes at most 5 bytes on the wire; a continuation carries up to two context's worth.
_TOKEN_ID_WIRE_BYTES = 10
# Regex syntax a Replace pattern may use around its literal characters and still remove only those.
_REGEX_SYNTAX = re.compile(r"\\A|\\z|\\Z|[\^$+*?{},0-9|()]")
_SAFE_PRE_TOKENIZERS = {"Metaspace", "ByteLevel", "Digits", "Split", "Punctuation", "Sequence"}


@dataclass(frozen=True, slots=True)
class PromptBound:
    """`max_bytes`: counted bytes above which a text cannot fit (0: no bound for this tokenizer)."""

    max_token_bytes: int
    max_model_len: int
    max_bytes: int
    collapsed: str = ""  # characters whose runs the normalizer collapses (counted all the same)
    reason: str = ""  # why there is no bound

    def check(self, field: str, *texts: str) -> None:
        """Raise InvalidRequestError(field) when `texts` together cannot fit the context."""
        size = over_bound(texts, self.max_bytes)
        if size is not None:
            raise InvalidRequestError(field, too_long_message(size, self.max_bytes, self.max_model_len))

    @property
    def max_request_bytes(self) -> int | None:
        """The largest legitimate Generate or Tokenize message (None without a bound)."""
        if not self.max_bytes:
            return None
        return 2 * self.max_bytes + _TOKEN_ID_WIRE_BYTES * self.max_model_len + REQUEST_HEADROOM_BYTES

    def describe(self) -> str:
        if not self.max_bytes:
            return f"no prompt byte bound ({self.reason})"
        spaces = f"; runs of {self.collapsed!r} count in full" if self.collapsed else ""
        return (
            f"prompts over {self.max_bytes} bytes refused before tokenizing "
            f"({self.max_model_len} tokens × {self.max_token_bytes} bytes{spaces})"
        )


def prompt_bound(hf: Tokenizer, max_model_len: int) -> PromptBound:
    """The bound of `hf` for a context of `max_model_len` tokens."""
    spec = json.loads(hf.to_str())
    longest = max((len(piece.encode("utf-8", "surrogatepass")) for piece in hf.get_vocab(True)), default=1)
    for added in spec.get("added_tokens") or ():
        longest = max(longest, len(str(added.get("content", "")).encode()))
    try:
        collapsed = _normalizer_removes(spec.get("normalizer"))
        _check_pipeline(spec)
    except _NoBound as exc:
        return PromptBound(longest, max_model_len, 0, reason=str(exc))
    model = spec.get("model") or {}
    if model.get("unk_token") is not None and not model.get("byte_fallback"):
        longest = max(longest, 4)  # an unknown character becomes one token
    chars = "".join(sorted(collapsed))
    return PromptBound(longest, max_model_len, max_model_len * longest, chars)


class _NoBound(Exception):
    """The tokenizer may shrink text in ways the bound does not model."""


def _normalizer_removes(node: dict[str, Any] | None) -> set[str]:
    """The characters the normalizer may remove; raises _NoBound for a normalizer it cannot bound."""
    if node is None:
        return set()
    kind = node.get("type")
    if kind == "Sequence":
        return set().union(*(_normalizer_removes(n) for n in node.get("normalizers", ())))
    if kind == "Prepend":
        return set()
    if kind == "Replace":
        pattern, content = node.get("pattern") or {}, str(node.get("content", ""))
        if "String" in pattern:
            literal = str(pattern["String"])
            return set() if len(content.encode()) >= len(literal.encode()) else set(literal)
        literal = _REGEX_SYNTAX.sub("", str(pattern.get("Regex", "")))
        if literal and not any(ch in literal for ch in "\\[].") and not content.strip(literal):
            return set(literal)  # e.g. " {2,}" → " ": only those characters ever go away
    raise _NoBound(f"the normalizer {kind} may shrink text")


def _check_pipeline(spec: dict[str, Any]) -> None:
    if spec.get("truncation"):
        raise _NoBound("the tokenizer truncates")
    pre = spec.get("pre_tokenizer")
    for node in _flatten(pre, "pretokenizers"):
        kind = node.get("type")
        if kind not in _SAFE_PRE_TOKENIZERS or str(node.get("behavior", "")).lower() == "removed":
            raise _NoBound(f"the pre-tokenizer {kind} may drop text")
    if any(added.get("lstrip") or added.get("rstrip") for added in spec.get("added_tokens") or ()):
        raise _NoBound("an added token absorbs the whitespace around it")
    model = spec.get("model") or {}
    kind = model.get("type")
    byte_level = any(node.get("type") == "ByteLevel" for node in _flatten(pre, "pretokenizers"))
    if kind == "BPE":
        if model.get("byte_fallback") or byte_level:
            return
        if model.get("unk_token") is not None and not model.get("fuse_unk"):
            return
        raise _NoBound("unknown characters may fuse into one token")
    if kind == "Unigram" and model.get("byte_fallback"):
        return
    raise _NoBound(f"the {kind} model may cover any length with one token")


def _flatten(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [leaf for child in node.get(key, ()) for leaf in _flatten(child, key)]
    return [node]
