"""The collectives a tensor-parallel model needs, behind one small interface.

`Communicator` has exactly what the sharded layers and the KV transfer use: an in-place sum across
ranks (row-parallel projections, the vocabulary-parallel embedding) and a gather to rank 0 (logits of
the vocabulary-parallel LM head, KV blocks). `TorchDistributed` implements it with torch.distributed:
gloo on the CPU, NCCL on CUDA. A model that runs whole has no communicator at all (None), so the
single-process path pays nothing.
"""

from __future__ import annotations

import datetime
import os
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

# A collective waits this long for a peer; the engine kills every worker long before (a dead worker
# is seen through its process sentinel), so this only bounds a worker whose engine vanished.
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


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


class TorchDistributed(Communicator):
    """torch.distributed's default process group, rendezvous through a file every rank can reach."""

    def __init__(
        self, backend: str, store_path: str, rank: int, world_size: int, device: torch.device
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: expected gloo or nccl, got {backend!r}")
        self.rank = rank
        self.world_size = world_size
        self.device = device
        if backend == "gloo":
            # Every rank runs on this host: loopback, whatever the hostname resolves to (or not).
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=_COLLECTIVE_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
        # The first collective sets up the connections (NCCL communicators): outside any CUDA graph.
        self.all_reduce(torch.zeros(1, device=device))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        tensor = tensor.contiguous()
        if self.rank != 0:
            dist.gather(tensor, None, dst=0)
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.gather(tensor, parts, dst=0)
        return parts

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"
