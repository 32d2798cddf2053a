"""Finding tags such as `<think>` or `<tool_call>` in text that arrives in pieces.

A delta may end in the middle of a tag; the text that could still become a tag is held back until the
next piece (or the end of the output) decides.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest complete marker in `text` as (position, marker); the longest wins a tie."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    return best


def partial_marker_start(text: str, markers: Sequence[str]) -> int:
    """Where the longest suffix of `text` that is a proper prefix of a marker starts (len(text) if none)."""
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        tail = text[start:]
        if any(marker.startswith(tail) for marker in markers):
            return start
    return len(text)
