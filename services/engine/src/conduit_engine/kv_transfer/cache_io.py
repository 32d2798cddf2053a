"""Between the paged KV cache and KvChunk payload bytes: the source reads blocks, the destination writes.

`KvBlockStore` is all a transfer asks of whoever owns the cache tensors: copy given blocks out as one
payload, and a payload into given blocks. It is the runner's own contract (`model_runner.Runner`): the
in-process ModelRunner and the worker-backed runner (tensor parallelism: each rank holds a shard of the KV
heads, and the runner assembles or splits the whole model's payload) both implement it, so the engine
hands its runner to the transfer code as is. `LocalKvBlocks` implements it for cache tensors held by
the caller (tests, benchmarks), through the ops' gather/scatter (one kernel each on CUDA).

A payload is the ops' transfer buffer (`Ops.gather_kv_blocks`) as raw little-endian bytes, laid out
[layer][k, v][block][block_size][kv_head][head_dim]. Reading gathers, copies to the host if needed and makes
the one `bytes` copy protobuf requires. Writing views the received bytes as a tensor without copying, moves
it to the cache's device if needed and scatters.

Both touch only blocks no step reads or writes meanwhile: a transfer's source blocks are pinned (nobody
writes a pinned block), and the destination blocks belong to a sequence not yet handed to the scheduler.
So they may run on any thread; on CUDA a write synchronises its stream before returning, so a later step
on another stream sees the data.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Protocol

import torch

from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.ops.base import Ops

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class KvBlockStore(Protocol):
    """The cache owner's side of a transfer: payloads of given block ids, out and in (safe to call from
    any thread for blocks no step reads or writes meanwhile)."""

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        """The payload of cache blocks `block_ids`, in that order."""
        ...

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes) -> None:
        """Store a payload of len(block_ids) blocks into cache blocks `block_ids`, in that order."""
        ...


def layout_of(model: str, kv_caches: KVCaches) -> KvLayoutSpec:
    """The KvLayoutSpec of these caches ([num_blocks, block_size, num_kv_heads, head_dim] per layer)."""
    _, block_size, num_kv_heads, head_dim = kv_caches[0][0].shape
    return KvLayoutSpec(
        model=model,
        dtype=str(kv_caches[0][0].dtype).removeprefix("torch."),
        block_size=block_size,
        num_layers=len(kv_caches),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def _require_little_endian() -> None:
    # Payloads are the tensors' memory as is; a big-endian host would have to swap every element.
    if sys.byteorder != "little":
        raise RuntimeError("KV transfer needs a little-endian host (KvChunk payloads are little-endian)")


class LocalKvBlocks:
    """KvBlockStore over cache tensors in this process, through the ops' gather/scatter."""

    def __init__(self, ops: Ops, kv_caches: KVCaches) -> None:
        _require_little_endian()
        self._ops = ops
        self._kv_caches = kv_caches
        first = kv_caches[0][0]
        self._device, self._dtype = first.device, first.dtype
        self._block_shape = tuple(first.shape[1:])

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self._device)
        buffer = self._ops.gather_kv_blocks(self._kv_caches, ids)
        return buffer.cpu().view(torch.uint8).numpy().tobytes()

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes) -> None:
        shape = (len(self._kv_caches), 2, len(block_ids), *self._block_shape)
        buffer = _view_bytes(data, self._dtype).view(shape)
        if self._device.type != "cpu":
            buffer = buffer.to(self._device)
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self._device)
        self._ops.scatter_kv_blocks(buffer, self._kv_caches, ids)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()


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

    async def write(self, first_block: int, num_blocks: int, data: bytes) -> None:
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


def _view_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `data`'s memory (no copy). torch warns that bytes are read-only; the scatter only
    reads its source, so the warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=dtype)
