"""Grammar masking in the sampler: the constrained rows of a step's logits, masked in one batched op.

A step's constrained rows come as one `StepBitmask` (built by structured.batch_mask.BitmaskBuilder):
an int32 bitmask [R, ceil(V/32)] and the logits row of each bitmask row. `apply_grammar_mask` sets the
logits of every disallowed token of those rows to -inf through the ops backend (`Ops.apply_token_bitmask`:
vectorised torch on the CPU, a raw kernel on CUDA). Rows not listed are not read or written, so
unconstrained requests in the batch keep exactly their logits and pay nothing; a step without
constrained rows has no `StepBitmask` at all.

Where: on the float32 logits before `Sampler.__call__`. Every later stage keeps -inf at -inf
(logit_bias adds a finite value, the repetition penalty multiplies or divides by a positive number,
presence/frequency penalties subtract finite values, min_tokens only adds -inf, temperature divides),
so masking first equals masking after the penalties, greedy rows take the argmax of the allowed tokens,
random rows give disallowed tokens probability 0, and logprobs give them -inf.

EOS: the grammar's own bitmask allows EOS exactly where the structure is complete, so no EOS rule is
needed here. Rows whose structure is complete with nothing else allowed are finished by the engine
before they reach the sampler (GrammarState.is_finished), so min_tokens cannot mask a row's last
allowed token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conduit_engine.ops.base import Ops


@dataclass(frozen=True, slots=True)
class StepBitmask:
    """bitmask [R, ceil(V/32)] int32 (bit t % 32 of word t // 32 set = token t allowed) and rows [R]
    int64 (the logits row of each bitmask row, distinct, any order), both on the logits' device."""

    bitmask: torch.Tensor
    rows: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def apply_grammar_mask(logits: torch.Tensor, mask: StepBitmask | None, ops: Ops) -> None:
    """Mask the constrained rows of logits [B, V] float32 in place; nothing to do when `mask` is None."""
    if mask is None or mask.num_rows == 0:
        return
    if logits.dtype != torch.float32:
        raise ValueError(f"logits: grammar masking needs float32 logits, got {logits.dtype}")
    ops.apply_token_bitmask(logits, mask.bitmask, mask.rows)
