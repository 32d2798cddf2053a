"""KV transfer objects ↔ engine.proto messages (KvLayout, KvHandle, KvConsume) and pull specs from handles."""

from __future__ import annotations

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.errors import InvalidRequestError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.params import KvConsume, KvFirstToken, KvHandleRef, SourceTransports
from conduit_engine.kv_transfer.registry import KvTransfer

_HANDLE = "kv_transfer.consume.handle"
_FIRST_TOKENS = "kv_transfer.consume.first_tokens"


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


def handle_to_pb(
    transfer: KvTransfer,
    source_address: str,
    layout: KvLayoutSpec,
    transports: SourceTransports = SourceTransports(),
) -> pb.KvHandle:
    """The KvHandle of a produced transfer (the final message of each KV_HANDOFF choice)."""
    return pb.KvHandle(
        transfer_id=transfer.transfer_id,
        source_address=source_address,
        num_tokens=transfer.num_tokens,
        layout=layout_to_pb(layout),
        expires_unix_ms=transfer.expires_unix_ms,
        transports=pb.KvSourceTransports(shm_host=transports.shm_host, nixl=transports.nixl),
        lora_name=transfer.lora_name or "",
    )


def handle_from_pb(handle: pb.KvHandle) -> KvHandleRef:
    """A consume request's handle, each field checked (InvalidRequestError naming it)."""
    if not handle.transfer_id:
        raise InvalidRequestError(f"{_HANDLE}.transfer_id", "must not be empty")
    if not handle.source_address:
        raise InvalidRequestError(f"{_HANDLE}.source_address", "must not be empty")
    if handle.num_tokens < 1:
        raise InvalidRequestError(f"{_HANDLE}.num_tokens", "must be >= 1")
    return KvHandleRef(
        transfer_id=handle.transfer_id,
        source_address=handle.source_address,
        num_tokens=handle.num_tokens,
        layout_fingerprint=handle.layout.fingerprint,
        transports=SourceTransports(handle.transports.shm_host, handle.transports.nixl),
        lora_name=handle.lora_name or None,
    )


def consume_from_pb(consume: pb.KvConsume) -> KvConsume:
    """kv_transfer.consume as a KvConsume: the handle's fields and at least one first token, each choice
    at most once (indices and token ids are checked against the request when it is admitted)."""
    handle = handle_from_pb(consume.handle)
    if not consume.first_tokens:
        raise InvalidRequestError(_FIRST_TOKENS, "at least one choice must continue on the decode engine")
    indices = [first.index for first in consume.first_tokens]
    if len(set(indices)) != len(indices):
        raise InvalidRequestError(_FIRST_TOKENS, f"a choice index appears twice in {indices}")
    firsts = sorted(consume.first_tokens, key=lambda first: first.index)
    return KvConsume(
        handle=handle,
        first_tokens=tuple(KvFirstToken(first.index, first.token_id) for first in firsts),
    )
