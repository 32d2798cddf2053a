"""One step's token bitmask: the constrained rows' masks filled into one reused int32 buffer.

`BitmaskBuilder.build(rows)` takes (logits row, GrammarState) for the sequences that have a structure,
keeps those whose state is active (gate open, not terminated), and fills one [R, ceil(V/32)] int32
bitmask on the CPU (the backend writes only host memory), copied once to the logits' device. Rows
without a structure never appear, so they cost nothing; with no active row, `build` returns None.

Buffers are allocated once and grown to the next power of two, never per step. The returned
`StepBitmask` holds views of them, valid until the next `build`: the step consumes it (the sampler
synchronises when it reads the sampled ids) before the next step builds again. On CUDA the host buffer
is pinned and the copy is asynchronous on the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from conduit_engine.sampling.grammar_mask import StepBitmask

if TYPE_CHECKING:  # the grammar backend (xgrammar) loads only once a request brings a grammar
    from conduit_engine.structured.state import GrammarState


class HasGrammar(Protocol):
    grammar: GrammarState | None


class BitmaskBuilder:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = torch.device(device)
        self._capacity = 0
        self._host = torch.empty((0, self.words), dtype=torch.int32)
        self._host_rows = torch.empty(0, dtype=torch.int64)
        self._device = self._host
        self._device_rows = self._host_rows

    def build(self, rows: Sequence[tuple[int, GrammarState]]) -> StepBitmask | None:
        """rows: (logits row, state) of each sequence with a structure sampled this step."""
        active = [(row, state) for row, state in rows if state.is_active]
        if not active:
            return None
        from conduit_engine.structured.state import GrammarState  # loaded: a request brought a grammar

        count = len(active)
        self._reserve(count)
        host, host_rows = self._host[:count], self._host_rows[:count]
        GrammarState.fill_bitmasks([state for _, state in active], host)
        host_rows.numpy()[:] = [row for row, _ in active]
        if self.device.type == "cpu":
            return StepBitmask(bitmask=host, rows=host_rows)
        bitmask, device_rows = self._device[:count], self._device_rows[:count]
        bitmask.copy_(host, non_blocking=True)
        device_rows.copy_(host_rows, non_blocking=True)
        return StepBitmask(bitmask=bitmask, rows=device_rows)

    def _reserve(self, count: int) -> None:
        if count <= self._capacity:
            return
        capacity = 1 << (count - 1).bit_length()
        pinned = self.device.type == "cuda"
        self._host = torch.empty((capacity, self.words), dtype=torch.int32, pin_memory=pinned)
        self._host_rows = torch.empty(capacity, dtype=torch.int64, pin_memory=pinned)
        if self.device.type == "cpu":
            self._device, self._device_rows = self._host, self._host_rows
        else:
            self._device = torch.empty((capacity, self.words), dtype=torch.int32, device=self.device)
            self._device_rows = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self._capacity = capacity


class SequenceMasks:
    """A step's bitmask from its sampled sequences (logits row i = sequence i): the rows with an output
    structure, through one BitmaskBuilder made on the first step that has any."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._builder: BitmaskBuilder | None = None

    def build(self, seqs: Sequence[HasGrammar]) -> StepBitmask | None:
        rows = [(i, seq.grammar) for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        if self._builder is None:
            self._builder = BitmaskBuilder(self.vocab_size, self.device)
        return self._builder.build(rows)
