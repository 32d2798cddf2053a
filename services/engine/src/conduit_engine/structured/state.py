"""One sequence's progress through its compiled structure (`GrammarState`).

The state is a pure function of the sequence's output token ids: `accept` each sampled token, and
`replay(output_ids)` rebuilds the same state from scratch (a sequence recomputed after preemption keeps
its output tokens, so its state needs nothing; a sequence whose state was dropped, or that arrives with
tokens made elsewhere, replays). `rollback(n)` undoes the last n tokens; `fork()` copies the state for
another choice of the same request.

Used by one thread at a time (the step loop): the backend's matcher is not thread-safe.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from conduit_engine.structured.after_gate import AfterGate
from conduit_engine.structured.backend import xgrammar as xgr
from conduit_engine.structured.vocabulary import GrammarVocab


class GrammarState:
    """The backend matcher plus the `after` gate and the output tokens seen so far."""

    def __init__(self, grammar: xgr.CompiledGrammar, vocab: GrammarVocab, after: str | None = None) -> None:
        self._grammar = grammar
        self._vocab = vocab
        self._after = after.encode() if after else None
        self._matcher = xgr.GrammarMatcher(grammar)
        self._gate = AfterGate(self._after) if self._after else None
        self._tokens: list[int] = []  # every accepted output token, before and after the gate
        self._start = 0 if self._gate is None else None  # index in _tokens where the matcher starts
        self._failed = False
        # Whether the matcher accepted EOS (it terminates exactly then); kept here because the step asks
        # for every row every step and a call into the backend costs more than the flag.
        self._terminated = False

    # ----- what the step loop asks ---------------------------------------------------------------------
    @property
    def is_active(self) -> bool:
        """Whether this step's logits row must be masked: the gate is open, and the grammar has neither
        terminated nor failed."""
        return self._start is not None and not self._failed and not self._terminated

    @property
    def accepts_eos(self) -> bool:
        """Whether EOS may be sampled now: before the gate, always; after it, where the grammar is
        complete. The bitmask encodes the same (EOS bits are set exactly then)."""
        return self._start is None or (not self._failed and self._matcher.is_completed())

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted EOS: the output is complete."""
        return self._start is not None and self._terminated

    @property
    def is_finished(self) -> bool:
        """The output is complete and nothing but EOS may follow: end the choice with STOP now, without
        sampling EOS (so `ignore_eos` and `min_tokens` cannot push it past the structure)."""
        if self.is_terminated:
            return True
        if self._start is None or self._failed or not self._matcher.is_completed():
            return False
        row = torch.empty((1, self._vocab.words), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(row)
        words = row.numpy().view(np.uint32)[0].copy()
        for eos in self._vocab.eos_token_ids:
            words[eos >> 5] &= ~np.uint32(1 << (eos & 31))
        return not words.any()

    @property
    def has_failed(self) -> bool:
        """A token the grammar rejects was offered (only possible if a row went unmasked)."""
        return self._failed

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [R, words] on the CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @staticmethod
    def fill_bitmasks(states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
        """`fill_bitmask` of every state into bitmask[0 : len(states)] in one backend call: half the
        time of a Python loop over the rows at batch 64 (bench/structured.py)."""
        _batch_matcher().batch_fill_next_token_bitmask([state._matcher for state in states], bitmask)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and `has_failed`) if the grammar rejects it."""
        if self._failed:
            return False
        if self._start is None:
            assert self._gate is not None
            self._tokens.append(token_id)
            if self._gate.feed(self._vocab.token_bytes[token_id]):
                self._start = len(self._tokens)
            return True
        if not self._matcher.accept_token(token_id):
            self._failed = True
            return False
        self._tokens.append(token_id)
        self._terminated = token_id in self._vocab.eos_token_ids
        return True

    # ----- re-deriving the state -------------------------------------------------------------------------
    def replay(self, output_ids: Iterable[int]) -> bool:
        """Reset, then accept every token; False if the tokens do not fit the grammar."""
        self._matcher.reset()
        self._gate = AfterGate(self._after) if self._after else None
        self._tokens, self._failed, self._terminated = [], False, False
        self._start = 0 if self._gate is None else None
        return all(self.accept(t) for t in output_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(f"num_tokens: must be in [0, {len(self._tokens)}], got {num_tokens}")
        in_matcher = 0 if self._start is None else len(self._tokens) - self._start
        if num_tokens <= in_matcher and not self._failed:
            self._matcher.rollback(num_tokens)
            del self._tokens[len(self._tokens) - num_tokens :]
            self._terminated = self._matcher.is_terminated()
        else:  # the gate must close again (or the state failed): rebuild it
            self.replay(self._tokens[: len(self._tokens) - num_tokens])

    def fork(self) -> GrammarState:
        """An independent copy in the same state (another choice continuing from here)."""
        twin = GrammarState.__new__(GrammarState)
        twin._grammar, twin._vocab, twin._after = self._grammar, self._vocab, self._after
        twin._matcher = self._matcher.fork()
        twin._gate = self._gate.copy() if self._gate is not None else None
        twin._tokens, twin._start, twin._failed = list(self._tokens), self._start, self._failed
        twin._terminated = self._terminated
        return twin


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    """The backend's batched filler (its threads: half the cores, as the backend chooses)."""
    return xgr.BatchGrammarMatcher(max_threads="auto")
