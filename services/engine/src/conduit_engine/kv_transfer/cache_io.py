"""Between the paged KV cache and KvChunk payload bytes: the source reads blocks, the destination writes.

`KvBlockStore` is all a transfer asks of whoever owns the cache tensors: copy given blocks out as one
payload, and a payload into given blocks. It is the executor's own contract (`executor.base.Executor`):
the in-process executor and the multi-process one (tensor parallelism: each rank holds a shard of the KV
heads, and the executor assembles or splits the whole model's payload) both implement it, so the engine
hands its executor to the transfer code as is.

A payload is the ops' transfer buffer (`Ops.gather_kv_blocks`) as raw little-endian bytes, laid out
[layer][k, v][block][block_size][kv_head][head_dim].

Both touch only blocks no step reads or writes meanwhile: a transfer's source blocks are pinned (nobody
writes a pinned block), and the destination blocks belong to a sequence not yet handed to the scheduler.
So they may run on any thread; on CUDA a write synchronises its stream before returning, so a later step
on another stream sees the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

Payload = bytes | memoryview  # a KvChunk's data, or a writable view of a shared-memory segment


class KvBlockStore(Protocol):
    """The cache owner's side of a transfer: payloads of given block ids, out and in (safe to call from
    any thread for blocks no step reads or writes meanwhile)."""

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        """The payload of cache blocks `block_ids`, in that order."""
        ...

    def gather_kv_blocks_into(self, block_ids: Sequence[int], out: memoryview) -> None:
        """Write the payload of cache blocks `block_ids` into `out` (writable, exactly its size: a slice
        of a shared-memory segment), through the ops' gather, with no bytes object in between."""
        ...

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: Payload) -> None:
        """Store a payload of len(block_ids) blocks into cache blocks `block_ids`, in that order (a
        writable memoryview is read in place)."""
        ...


class CacheBlockWriter:
    """Destination side (a KvBlockSink): payload bytes → the cache blocks a pull plan allocated.

    `dest_block_ids[i]` receives transfer block `start_block + i`; `block_bytes` is one block's share of a
    payload (KvLayoutSpec.block_bytes). Each write stores its payload before returning (no await inside):
    a pull cancelled between chunks never leaves a write half done.
    """

    def __init__(
        self, store: KvBlockStore, block_bytes: int, dest_block_ids: Sequence[int], start_block: int
    ) -> None:
        self._store = store
        self._block_bytes = block_bytes
        self._dest = list(dest_block_ids)
        self._start = start_block
        self.blocks_written = 0

    def destination_blocks(self) -> list[int]:
        """The cache block receiving each pulled block (for transports that write the cache directly)."""
        return list(self._dest)

    def written_directly(self, num_blocks: int) -> None:
        """A transport stored `num_blocks` more blocks into `destination_blocks()` itself."""
        self.blocks_written += num_blocks

    async def write(self, first_block: int, num_blocks: int, data: Payload) -> None:
        index = first_block - self._start
        if index < 0 or num_blocks < 1 or index + num_blocks > len(self._dest):
            raise ValueError(
                f"first_block: blocks [{first_block}, {first_block + num_blocks}) are outside the pull's "
                f"[{self._start}, {self._start + len(self._dest)})"
            )
        expected = num_blocks * self._block_bytes
        if len(data) != expected:
            raise ValueError(f"data: {num_blocks} blocks take {expected} bytes, got {len(data)}")
        self._store.scatter_kv_blocks(self._dest[index : index + num_blocks], data)
        self.blocks_written += num_blocks
