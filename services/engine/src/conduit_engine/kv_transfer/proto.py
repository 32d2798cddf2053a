"""KV transfer objects ↔ engine.proto messages (KvLayout, KvHandle) and pull specs from handles."""

from __future__ import annotations

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.errors import InvalidRequestError
from conduit_engine.kv_transfer.errors import KvLayoutMismatchError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.registry import KvTransfer
from conduit_engine.kv_transfer.transport import KvPullSpec

_HANDLE = "kv_transfer.consume.handle"


def layout_to_pb(layout: KvLayoutSpec) -> pb.KvLayout:
    """GetModelInfo.kv_layout and KvHandle.layout."""
    return pb.KvLayout(
        model=layout.model,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        fingerprint=layout.fingerprint,
    )


def handle_to_pb(transfer: KvTransfer, source_address: str, layout: KvLayoutSpec) -> pb.KvHandle:
    """The KvHandle of a produced transfer (the final message of each KV_HANDOFF choice)."""
    return pb.KvHandle(
        transfer_id=transfer.transfer_id,
        source_address=source_address,
        num_tokens=transfer.num_tokens,
        layout=layout_to_pb(layout),
        expires_unix_ms=transfer.expires_unix_ms,
    )


def check_handle(handle: pb.KvHandle, layout: KvLayoutSpec) -> None:
    """Validate a consume request's handle against this (the puller's) layout, naming the bad field."""
    if not handle.transfer_id:
        raise InvalidRequestError(f"{_HANDLE}.transfer_id", "must not be empty")
    if not handle.source_address:
        raise InvalidRequestError(f"{_HANDLE}.source_address", "must not be empty")
    if handle.num_tokens < 1:
        raise InvalidRequestError(f"{_HANDLE}.num_tokens", "must be >= 1")
    if handle.layout.fingerprint != layout.fingerprint:
        raise KvLayoutMismatchError(
            f"{_HANDLE}.layout.fingerprint: {handle.layout.fingerprint or '(empty)'} differs from this "
            f"engine's {layout.fingerprint}: the two engines cannot exchange KV blocks"
        )


def pull_spec_for(handle: pb.KvHandle, layout: KvLayoutSpec, start_block: int) -> KvPullSpec:
    """The pull of `handle`'s blocks from `start_block` on (from the pull plan)."""
    check_handle(handle, layout)
    return KvPullSpec(
        source_address=handle.source_address,
        transfer_id=handle.transfer_id,
        start_block=start_block,
        total_blocks=layout.num_blocks(handle.num_tokens),
        layout=layout,
    )
