"""KV blocks held by a test (or a benchmark) itself: a KvBlockStore over cache tensors in this process,
their KvLayoutSpec, and the pull spec of a handle, which the engine itself builds from a pull plan."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.checks import check_layout
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.params import KvHandleRef
from conduit_engine.kv_transfer.proto import handle_from_pb
from conduit_engine.kv_transfer.transport import KvPullSpec
from conduit_engine.ops.base import Ops

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


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

    def gather_kv_blocks_into(self, block_ids: Sequence[int], out: memoryview) -> None:
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self._device)
        shape = (len(self._kv_caches), 2, len(block_ids), *self._block_shape)
        self._ops.gather_kv_blocks(
            self._kv_caches, ids, out=torch.frombuffer(out, dtype=self._dtype).view(shape)
        )

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        shape = (len(self._kv_caches), 2, len(block_ids), *self._block_shape)
        buffer = _view_bytes(data, self._dtype).view(shape)
        if self._device.type != "cpu":
            buffer = buffer.to(self._device)
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self._device)
        self._ops.scatter_kv_blocks(buffer, self._kv_caches, ids)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()


def _view_bytes(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `data`'s memory (no copy). torch warns that bytes are read-only; the scatter only
    reads its source, so the warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=dtype)


def pull_spec(handle: KvHandleRef, layout: KvLayoutSpec, start_block: int) -> KvPullSpec:
    """The pull of `handle`'s blocks from `start_block` on (from the pull plan)."""
    check_layout(handle, layout)
    return KvPullSpec(
        source_address=handle.source_address,
        transfer_id=handle.transfer_id,
        start_block=start_block,
        total_blocks=layout.num_blocks(handle.num_tokens),
        layout=layout,
        transports=handle.transports,
    )


def pull_spec_for(handle: pb.KvHandle, layout: KvLayoutSpec, start_block: int) -> KvPullSpec:
    """`pull_spec` of a KvHandle message."""
    return pull_spec(handle_from_pb(handle), layout, start_block)


def nixl_endpoint_or_skip(kv_caches: KVCaches):
    """A NixlKvEndpoint over `kv_caches`; where NIXL cannot start the test skips saying why, except in CI
    (CI=true), whose install has the wheel: there it fails."""
    import pytest

    from conduit_engine.kv_transfer.nixl_agent import NixlKvEndpoint

    try:
        return NixlKvEndpoint(kv_caches, timeout_s=30)
    except Exception as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"NIXL must start in CI: {exc}")
        pytest.skip(f"NIXL cannot start here: {exc}")


def shm_segments() -> set[str]:
    """The KV transfer segments in /dev/shm now (none may outlive a pull)."""
    return {p.name for p in Path("/dev/shm").glob("conduit-kv-*")}
