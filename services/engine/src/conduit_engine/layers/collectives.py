"""The collectives a tensor-parallel model needs, behind one small interface.

`Communicator` has exactly what the sharded layers and the KV transfer use: an in-place sum across
ranks (row-parallel projections, the vocabulary-parallel embedding) and a gather to rank 0 (logits of
the vocabulary-parallel LM head, KV blocks). The worker processes implement it (`worker/comm.py`). A
model that runs whole has no communicator at all (None), so the single-process path pays nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Communicator(ABC):
    """One rank's view of the group; every rank calls every collective in the same order."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` across ranks, in place."""

    @abstractmethod
    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 receives every rank's `tensor` (same shape on all ranks), in rank order; others None."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group (idempotent)."""
