"""Incremental detokenization of one choice's output tokens into text deltas, with stop strings.

Exactness: after any number of steps, the released text plus `finish()` equals what decoding the whole
output gives: `tokenizer.decode(context + output)` minus `decode(context)`, where the context is up to
five text tokens at the end of the prompt (as vLLM's prefix/read offsets do). The context is what
keeps the first output token's leading space ("▁the" → " the"); when the prompt has no text tokens
(empty, or only special tokens) the result is exactly `tokenizer.decode(output)`. Special tokens are
never context; trailing byte-fallback tokens of the prompt are not context either (their bytes would
otherwise merge with the output's).

What is held back, and why:
- A trailing run of SentencePiece byte-fallback tokens (`<0xNN>`): the decoder turns the whole run into
  U+FFFD per byte as soon as any part of it is invalid UTF-8, so a later byte can change how earlier
  bytes of the same run read (an emoji followed by a stray continuation byte reads as five U+FFFD).
  The run is final once a non-byte token follows (skipped special tokens are dropped on intake: they
  decode to nothing and do not end a run).
- Text ending in U+FFFD (an incomplete UTF-8 tail of a byte-level BPE tokenizer, as vLLM does).
- The longest tail of the text that is still the beginning of a stop string.

Stop strings: the first match to complete wins (smallest end; at equal ends the longer, earlier-starting
one), which is the match a token-by-token stream sees first whatever the token boundaries are. The stop
string and everything after it are cut, unless include_stop_str_in_output keeps the stop string.

Cost per step: at most two decodes of a window of a few tokens (the last released group plus what is
held), never the whole output; a long run of byte-fallback tokens widens the window until it ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import tokenizers

_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class DetokenizerDelta(NamedTuple):
    text: str  # text released to the client by this step ("" while held back)
    stop_string: str | None  # set when a stop string matched: generation must end now


@dataclass(frozen=True, slots=True)
class _TokenizerTraits:
    byte_ids: frozenset[int]  # ids of the byte-fallback pieces <0x00>..<0xFF>
    special_ids: frozenset[int]  # ids of added tokens marked special


_TRAITS: weakref.WeakKeyDictionary[tokenizers.Tokenizer, _TokenizerTraits] = weakref.WeakKeyDictionary()


def _traits(tokenizer: tokenizers.Tokenizer) -> _TokenizerTraits:
    traits = _TRAITS.get(tokenizer)
    if traits is None:
        byte_ids = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        traits = _TokenizerTraits(
            byte_ids=frozenset(i for i in byte_ids if i is not None),
            special_ids=frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special),
        )
        _TRAITS[tokenizer] = traits
    return traits


class IncrementalDetokenizer:
    """Turns the tokens of one choice, a few per step, into released text deltas."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        traits = _traits(tokenizer)
        self._byte_ids = traits.byte_ids
        self._dropped = traits.special_ids if skip_special_tokens else frozenset()
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1

        # tokens[prefix:read] decoded gave prefix_text; tokens[read:] are not released yet.
        self._tokens = _context(prompt_token_ids, self._byte_ids, traits.special_ids)
        self._prefix = 0
        self._read = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)
        self._run_start: int | None = None  # start of the trailing byte-fallback run, if any

        self._held = ""  # final text held back because its tail may begin a stop string
        self._released: list[str] = []
        self._released_text: str | None = ""
        self._stop_string: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text released so far (deltas and finish())."""
        if self._released_text is None:
            self._released_text = "".join(self._released)
        return self._released_text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the choice (from step() or finish()), or None."""
        return self._stop_string

    def step(self, new_token_ids: Sequence[int], *, match_stops: bool = True) -> DetokenizerDelta:
        """Add this step's tokens; return the text now safe to release. Ignores tokens after a stop.

        `match_stops=False` releases the text without looking for stop strings (the caller's stop rules
        hold them off, e.g. until min_tokens), and so holds nothing back for them either.
        """
        if self._finished:
            raise RuntimeError("step() after finish()")
        if self._stop_string is not None:
            return DetokenizerDelta("", None)
        for token_id in new_token_ids:
            self._append(token_id)
        return self._release(self._advance(), final=False, match_stops=match_stops)

    def finish(self) -> str:
        """Release everything still held; the choice ended (length, EOS, abort). Idempotent."""
        if self._finished or self._stop_string is not None:
            self._finished = True
            return ""
        self._finished = True
        tail = ""
        if len(self._tokens) > self._read:
            tail = self._decode(self._tokens[self._prefix :])[len(self._prefix_text) :]
        return self._release(tail, final=True, match_stops=True).text

    def _append(self, token_id: int) -> None:
        if token_id in self._dropped:
            return
        if token_id in self._byte_ids:
            if self._run_start is None:
                self._run_start = len(self._tokens)
        else:
            self._run_start = None
        self._tokens.append(token_id)

    def _advance(self) -> str:
        """Decode the newly final tokens; return their text ("" while nothing new is final)."""
        end = len(self._tokens) if self._run_start is None else self._run_start
        if end <= self._read:
            return ""
        text = self._decode(self._tokens[self._prefix : end])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = text[len(self._prefix_text) :]
        # The released group becomes the next window's prefix: it anchors the leading-space strip.
        self._prefix_text = self._decode(self._tokens[self._read : end])
        self._prefix, self._read = self._read, end
        # Forget what no window will read again, so memory stays O(window) too.
        del self._tokens[: self._prefix]
        self._read -= self._prefix
        if self._run_start is not None:
            self._run_start -= self._prefix
        self._prefix = 0
        return delta

    def _release(self, text: str, *, final: bool, match_stops: bool) -> DetokenizerDelta:
        if not self._stops or not match_stops:
            return self._emit(text, None)  # nothing is held while stop strings are not looked for
        buffer = self._held + text
        match = _first_stop_match(buffer, self._stops)
        if match is not None:
            start, stop = match
            self._held = ""
            self._stop_string = stop
            cut = start + len(stop) if self._include_stop else start
            return self._emit(buffer[:cut], stop)
        hold = 0 if final else _stop_prefix_length(buffer, self._stops, self._max_hold)
        self._held = buffer[len(buffer) - hold :]
        return self._emit(buffer[: len(buffer) - hold], None)

    def _emit(self, text: str, stop: str | None) -> DetokenizerDelta:
        if text:
            self._released.append(text)
            self._released_text = None
        return DetokenizerDelta(text, stop)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def _context(prompt: Sequence[int], byte_ids: frozenset[int], special_ids: frozenset[int]) -> list[int]:
    """Up to _CONTEXT_TOKENS text tokens from the end of the prompt, without a trailing byte run."""
    context: list[int] = []
    for token_id in reversed(prompt):
        if token_id in special_ids or (not context and token_id in byte_ids):
            continue
        context.append(token_id)
        if len(context) == _CONTEXT_TOKENS:
            break
    context.reverse()
    return context


def _first_stop_match(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop) of the match that ends first; at equal ends the one that starts first."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        key = (start + len(stop), start, stop)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2])


def _stop_prefix_length(text: str, stops: tuple[str, ...], max_hold: int) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    for length in range(min(len(text), max_hold), 0, -1):
        tail = text[-length:]
        if any(stop.startswith(tail) for stop in stops):
            return length
    return 0
