"""The worker processes' collectives: `TorchDistributed` implements `layers.collectives.Communicator`
with torch.distributed, gloo on the CPU and NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from conduit_engine.layers.collectives import Communicator

# A collective waits this long for a peer; the engine kills every worker long before (a dead worker
# is seen through its process sentinel), so this only bounds a worker whose engine vanished.
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


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
