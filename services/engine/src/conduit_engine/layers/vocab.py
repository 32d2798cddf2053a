"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous shard of the vocabulary rows.

Embedding: a rank looks up the ids inside its shard, writes zeros for the others, and an all-reduce
sums the ranks' rows (exactly one rank contributes each token). LM head: each rank computes the logits
of its shard (through the ops backend's linear, as every projection: layers/linear.py) and rank 0
gathers them into [S, vocab_size] (the padding of the last shard dropped); the other ranks get None.
Without a communicator both are the plain embedding / projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from conduit_engine.layers.linear import Linear
from conduit_engine.ops import Ops

if TYPE_CHECKING:
    from conduit_engine.layers.collectives import Communicator


class VocabParallelEmbedding(nn.Embedding):
    def __init__(
        self, shard_rows: int, dim: int, vocab_start: int = 0, comm: Communicator | None = None
    ) -> None:
        # The weights come from the checkpoint: no random init (on the meta device it would also load
        # torch's compiler stack, seconds of start-up).
        super().__init__(shard_rows, dim, _weight=torch.empty(shard_rows, dim))
        self.vocab_start = vocab_start
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.comm.all_reduce(out)
        return out


class ParallelLMHead(Linear):
    """logits = hidden @ weight.T; `weight` [shard_rows, H] may be the embedding's (tied)."""

    def __init__(
        self, shard_rows: int, dim: int, vocab_size: int, ops: Ops, comm: Communicator | None = None
    ) -> None:
        super().__init__(dim, shard_rows, False, ops)
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = self.ops.linear(hidden, self.weight, None, self.weight_scale)
        if self.comm is None:
            return logits
        parts = self.comm.gather(logits)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
