"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt or output.

Plain Python. Each sequence keeps an index (n-gram → the position just after its latest occurrence)
that grows with the sequence, so a proposal costs O(max - min + k) per step, not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The n-gram index of one sequence's tokens, for n in [lo, hi]."""

    __slots__ = ("_hi", "_lo", "_next", "_upto")

    def __init__(self, lo: int, hi: int) -> None:
        self._lo, self._hi = lo, hi
        self._next: dict[tuple[int, ...], int] = {}
        self._upto = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens continuing `tokens` (empty: no earlier occurrence of any suffix)."""
        end = len(tokens)
        self._extend(tokens, end - 1)  # every n-gram ending before the last token's suffix
        for n in range(min(self._hi, end - 1), self._lo - 1, -1):
            start = self._next.get(tuple(tokens[end - n : end]))
            if start is not None:
                return list(tokens[start : min(start + k, end)])
        return []

    def _extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams ending at positions [self._upto, upto) (so followed by a token)."""
        table = self._next
        for stop in range(max(self._upto, self._lo), upto + 1):
            for n in range(self._lo, min(self._hi, stop) + 1):
                table[tuple(tokens[stop - n : stop])] = stop
        self._upto = max(self._upto, upto + 1)
