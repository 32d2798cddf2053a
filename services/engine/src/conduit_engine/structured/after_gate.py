"""The `after` gate: a constraint starts only once a given text (a reasoning end tag) has been output.

How the sequence detects the text: by the bytes of its output tokens, as the grammar backend's
vocabulary spells them (`GrammarVocab.token_bytes`), matched against the UTF-8 of `after` over a
rolling window. Why bytes of token ids rather than the alternatives:
- Matching token ids of the tag is wrong whenever the model spells the tag with other tokens: `</think>`
  is one added token in Qwen3 and DeepSeek-R1 but several pieces (`</`, `think`, `>`) in a Llama vocab,
  and a piece may carry neighbouring text (`.</`).
- Matching the detokenized text ties the gate to the engine's output path: the detokenizer holds text
  back (stop strings, incomplete UTF-8) and is not replayed on preemption, so the gate could open a step
  late or not be re-derivable.
- Token bytes are exact for any spelling (also a UTF-8 character split over byte-fallback tokens),
  cost O(len(after)) per token, and depend only on the output token ids, so a preempted or transferred
  sequence re-derives the gate by replaying its output tokens.
The constraint starts with the token after the one that completes the text; bytes that same token
carries after the tag are free text. Until then the output is free (EOS included).
"""

from __future__ import annotations


class AfterGate:
    """Watches output token bytes for `after`; `is_open` once it has appeared."""

    __slots__ = ("_after", "_tail", "is_open")

    def __init__(self, after: bytes) -> None:
        if not after:
            raise ValueError("after: must not be empty")
        self._after = after
        self._tail = b""  # the last len(after) - 1 bytes seen: a match may straddle tokens
        self.is_open = False

    def feed(self, piece: bytes) -> bool:
        """Add one token's bytes; return whether the gate is open after it."""
        if self.is_open:
            return True
        window = self._tail + piece
        if self._after in window:
            self.is_open, self._tail = True, b""
        else:
            keep = len(self._after) - 1
            self._tail = window[-keep:] if keep else b""
        return self.is_open

    def copy(self) -> AfterGate:
        twin = AfterGate(self._after)
        twin._tail, twin.is_open = self._tail, self.is_open
        return twin
