"""The cheap size test both sides make before a prompt is tokenized.

An engine whose tokenizer allows it publishes a byte bound (GetModelInfo.max_prompt_bytes): no token
covers more than L bytes of text, so a text of more than context × L UTF-8 bytes can never fit the
context, and is refused without being tokenized.
"""

from __future__ import annotations

from collections.abc import Iterable


def over_bound(texts: Iterable[str], max_bytes: int) -> int | None:
    """The UTF-8 bytes of `texts` together when they exceed `max_bytes` (0: no bound), else None."""
    if max_bytes <= 0:
        return None
    # An ASCII string's length is its size in bytes (CPython knows it is ASCII without a scan).
    total = sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return total if total > max_bytes else None


def too_long_message(size: int, max_bytes: int, max_model_len: int, at_least: bool = False) -> str:
    """The reason both sides give (after the field name) for a prompt over the bound (`at_least`: the
    size is a lower bound, measured without decoding the text)."""
    return (
        f"prompt is {'at least ' if at_least else ''}{size} bytes of text, more than the {max_bytes} "
        f"bytes the model's context of {max_model_len} tokens can hold"
    )


def context_message(prompt_len: int, max_model_len: int) -> str:
    """The reason both sides give for a prompt of too many tokens."""
    return (
        f"prompt has {prompt_len} tokens; the model's context is {max_model_len} "
        "tokens and at least one must remain for the completion"
    )


def is_too_long(details: str) -> bool:
    """Whether an engine's INVALID_ARGUMENT message (after "field: ") says the prompt cannot fit."""
    reason = details.partition(": ")[2]
    return reason.startswith("prompt is ") and "bytes the model's context" in reason
