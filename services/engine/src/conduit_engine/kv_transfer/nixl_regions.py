"""Where a NIXL agent's KV cache shard lies, and the read descriptors between two shards (torch-free).

A shard is one engine rank's cache: per layer a K and a V region of [num_blocks][block_size][heads][head
bytes], holding the model's KV heads [head_start, head_start + head_count) (all of them without tensor
parallelism, a slice per rank with it). Reading blocks of a remote shard into a local one takes, for every
region and block pair, the heads both shards hold: when both hold exactly the same heads a block is one
contiguous run (and consecutive blocks merge), otherwise each token's heads are (a token's row of heads
is contiguous in both), so a descriptor per region, block and token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransferError


@dataclass(frozen=True, slots=True)
class NixlRegions:
    """One agent's registered KV cache shard (KvNixlRank without the metadata)."""

    agent_name: str
    memory: str  # DRAM or VRAM
    device_id: int
    regions: tuple[int, ...]  # base addresses: layer 0's K, layer 0's V, layer 1's K, ...
    block_stride: int  # bytes of one block in one region
    head_start: int
    head_count: int

    @property
    def head_end(self) -> int:
        return self.head_start + self.head_count

    def to_pb(self, metadata: bytes = b"") -> pb.KvNixlRank:
        return pb.KvNixlRank(
            agent_name=self.agent_name,
            agent_metadata=metadata,
            memory=self.memory,
            device_id=self.device_id,
            region_addresses=self.regions,
            block_stride=self.block_stride,
            kv_head_start=self.head_start,
            kv_head_count=self.head_count,
        )

    @classmethod
    def from_pb(cls, rank: pb.KvNixlRank) -> NixlRegions:
        return cls(
            rank.agent_name,
            rank.memory,
            rank.device_id,
            tuple(rank.region_addresses),
            rank.block_stride,
            rank.kv_head_start,
            rank.kv_head_count,
        )

    def to_json(self) -> dict[str, object]:
        return {
            "agent_name": self.agent_name,
            "memory": self.memory,
            "device_id": self.device_id,
            "regions": list(self.regions),
            "block_stride": self.block_stride,
            "head_start": self.head_start,
            "head_count": self.head_count,
        }

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> NixlRegions:
        return cls(
            str(doc["agent_name"]),
            str(doc["memory"]),
            int(doc["device_id"]),  # type: ignore[call-overload]
            tuple(int(a) for a in doc["regions"]),  # type: ignore[attr-defined]
            int(doc["block_stride"]),  # type: ignore[call-overload]
            int(doc["head_start"]),  # type: ignore[call-overload]
            int(doc["head_count"]),  # type: ignore[call-overload]
        )


def source_ranks(blocks: pb.KvNixlBlocks, num_kv_heads: int) -> list[tuple[NixlRegions, bytes]]:
    """The source's shards and their metadata (b"" when the puller holds it) from a NIXL answer; a source
    that fills only the single-agent fields holds every head."""
    if blocks.ranks:
        return [(NixlRegions.from_pb(rank), rank.agent_metadata) for rank in blocks.ranks]
    whole = NixlRegions(
        blocks.agent_name,
        blocks.memory,
        blocks.device_id,
        tuple(blocks.region_addresses),
        blocks.block_stride,
        0,
        num_kv_heads,
    )
    return [(whole, blocks.agent_metadata)]


def check_source(ranks: Sequence[NixlRegions], num_regions: int, num_kv_heads: int) -> None:
    """KvTransferError unless the shards cover the model's KV heads once, in order, each with
    `num_regions` regions, in a memory NIXL knows."""
    problem = None
    expected_start = 0
    for rank in ranks:
        if not rank.agent_name:
            problem = "a rank without an agent name"
        elif rank.memory not in ("DRAM", "VRAM"):
            problem = f"memory {rank.memory!r} is neither DRAM nor VRAM"
        elif len(rank.regions) != num_regions:
            problem = f"{len(rank.regions)} regions, this cache has {num_regions}"
        elif rank.head_start != expected_start or rank.head_count < 1:
            problem = f"KV heads [{rank.head_start}, {rank.head_end}) where head {expected_start} comes next"
        if problem is not None:
            break
        expected_start = rank.head_end
    if problem is None and expected_start != num_kv_heads:
        problem = f"the ranks hold {expected_start} KV heads, the model has {num_kv_heads}"
    if problem is not None:
        raise KvTransferError(f"the source's NIXL blocks do not fit the pull: {problem}")


def read_descriptors(
    local: NixlRegions,
    remote: NixlRegions,
    dst_ids: Sequence[int],
    src_ids: Sequence[int],
    block_size: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(local, remote) Nx3 descriptor tables (address, length, device) reading the KV heads both shards
    hold from remote blocks `src_ids` into local blocks `dst_ids` (pairwise); None when they share none.
    KvTransferError when the shards' head sizes differ."""
    lo, hi = max(local.head_start, remote.head_start), min(local.head_end, remote.head_end)
    if lo >= hi:
        return None
    head_bytes = local.block_stride // (block_size * local.head_count)
    if remote.block_stride != head_bytes * block_size * remote.head_count:
        raise KvTransferError(
            f"the source's NIXL blocks do not fit the pull: block stride {remote.block_stride} for "
            f"{remote.head_count} heads, this cache's is {local.block_stride} for {local.head_count}"
        )
    src = np.asarray(src_ids, dtype=np.uint64)
    dst = np.asarray(dst_ids, dtype=np.uint64)
    whole = (lo, hi) == (local.head_start, local.head_end) == (remote.head_start, remote.head_end)
    if whole:  # runs of blocks consecutive on both sides, each one contiguous run per region
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        runs = np.diff(np.concatenate([starts, [len(src)]])).astype(np.uint64)
        return (
            _table(local, dst[starts] * np.uint64(local.block_stride), runs * np.uint64(local.block_stride)),
            _table(
                remote, src[starts] * np.uint64(remote.block_stride), runs * np.uint64(local.block_stride)
            ),
        )
    length = np.uint64((hi - lo) * head_bytes)

    def offsets(shard: NixlRegions, ids: np.ndarray) -> np.ndarray:
        """Offset of the shared heads of each (block, token), blocks major."""
        token = np.arange(block_size, dtype=np.uint64) * np.uint64(shard.head_count * head_bytes)
        skip = np.uint64((lo - shard.head_start) * head_bytes)
        return ((ids * np.uint64(shard.block_stride))[:, None] + token[None, :] + skip).reshape(-1)

    lengths = np.full(len(dst) * block_size, length, dtype=np.uint64)
    return _table(local, offsets(local, dst), lengths), _table(remote, offsets(remote, src), lengths)


def _table(shard: NixlRegions, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A row per region and offset: region base + offset, its length, the shard's device."""
    bases = np.asarray(shard.regions, dtype=np.uint64)
    out = np.empty((len(bases) * len(offsets), 3), dtype=np.uint64)
    out[:, 0] = (bases[:, None] + offsets[None, :]).reshape(-1)
    out[:, 1] = np.tile(lengths, len(bases))
    out[:, 2] = shard.device_id
    return out
