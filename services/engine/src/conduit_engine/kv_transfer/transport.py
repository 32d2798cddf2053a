"""The KvTransport interface: how a decode engine fetches a produced transfer's blocks from its source.

A pull names the source (address and transfer id), the first block it needs (`start_block`: earlier blocks
were prefix-cache hits on the puller) and the puller's layout. The transport delivers blocks
[start_block, total_blocks) in order to a `KvBlockSink`, each run as one payload in the KvChunk layout
([layer][k, v][block][block_size][kv_head][head_dim], little-endian), and returns once all are written.
Failures are the errors of `kv_transfer.errors`: NOT_FOUND (unknown, released or expired id), UNAVAILABLE
(source down or silent), FAILED_PRECONDITION (layouts differ), anything else a plain KvTransferError.
The caller treats every one of them the same way: it recomputes the prompt (see pull_plan.abandon_pull).

Three implementations (chosen per pull by `puller.KvPuller`, see `setup` for --kv-transport):
`GrpcKvTransport` (grpc_transport.py) moves the bytes over the PullKv RPC; `ShmKvTransport`
(shm_transport.py) has the source write them into a shared-memory segment the puller made (same host);
`NixlKvTransport` (nixl_transport.py) reads them one-sided with NIXL straight into the puller's cache
blocks (its sink is a `DirectKvBlockSink`, which names them) and then releases the transfer. The last
two keep the PullKv call as their control path, so the spec, the sink's ordering guarantee, the errors,
the security checks and the registry's lifecycle are the same; a transport that cannot be used for a
pull raises KvTransportUnavailableError and the puller pulls over gRPC. `release` stays a small control
call (ReleaseKv) in any transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.params import SourceTransports


@dataclass(frozen=True, slots=True)
class KvPullSpec:
    """One pull: where from, which blocks, and the puller's layout (fingerprint and block bytes)."""

    source_address: str  # HOST:PORT the source engine advertises
    transfer_id: str
    start_block: int  # first transfer block to fetch
    total_blocks: int  # blocks of the whole transfer
    layout: KvLayoutSpec
    transports: SourceTransports = SourceTransports()  # what the source serves besides gRPC

    def __post_init__(self) -> None:
        if not 0 <= self.start_block <= self.total_blocks:
            raise ValueError(
                f"start_block: must lie in [0, {self.total_blocks}] (the transfer's blocks), "
                f"got {self.start_block}"
            )

    @property
    def num_blocks(self) -> int:
        return self.total_blocks - self.start_block


@dataclass(frozen=True, slots=True)
class KvPullResult:
    """What a completed pull moved."""

    num_blocks: int
    num_bytes: int


class KvBlockSink(Protocol):
    """Receives a pull's blocks: runs of consecutive transfer blocks, in order, each exactly once."""

    async def write(self, first_block: int, num_blocks: int, data: bytes | memoryview) -> None:
        """Store transfer blocks [first_block, first_block + num_blocks) from one payload."""
        ...


class DirectKvBlockSink(KvBlockSink, Protocol):
    """A sink whose cache blocks a transport may write itself (NIXL reads straight into the cache)."""

    def destination_blocks(self) -> list[int]:
        """The cache block receiving each pulled block, from spec.start_block on."""
        ...

    def written_directly(self, num_blocks: int) -> None:
        """The transport stored `num_blocks` more blocks into destination_blocks() itself."""
        ...


class KvTransport(ABC):
    """Fetches transfer blocks from a source engine into a sink."""

    @abstractmethod
    async def pull(
        self, spec: KvPullSpec, sink: KvBlockSink, metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult:
        """Deliver blocks [spec.start_block, spec.total_blocks) to `sink`; return when all are written.
        `metadata` goes with the pull's call (the W3C trace context of the puller's span).

        Raises KvTransferNotFoundError, KvSourceUnavailableError, KvLayoutMismatchError or another
        KvTransferError; after an error some blocks may have been written, none committed.
        """

    @abstractmethod
    async def release(self, source_address: str, transfer_id: str) -> bool:
        """Ask the source to free a transfer now (after a failed pull); True when it was pending there.

        Raises KvTransferError when the source cannot be asked.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release connections; the transport is not used afterwards."""
