"""KvTransport over gRPC: the source streams KvChunk messages from PullKv, the puller hands them to a sink.

One grpc.aio channel per source address, kept for the transport's life (the sources are the deployment's
prefill engines, a short list). Channels belong to the event loop that made them: one transport per loop.
Each chunk is checked against the pull (order, block counts, payload size) before the sink sees it, so
a confused or hostile source cannot write outside the blocks the pull planned.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_common.engine_dialer import PLAINTEXT, EngineDialer
from conduit_engine.kv_transfer.errors import (
    KvLayoutMismatchError,
    KvSourceUnavailableError,
    KvTransferError,
    KvTransferNotFoundError,
    KvTransportUnavailableError,
)
from conduit_engine.kv_transfer.transport import KvBlockSink, KvPullResult, KvPullSpec, KvTransport

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the engines' default gRPC message limit
DEFAULT_TIMEOUT_S = 60.0

_ERRORS: dict[grpc.StatusCode, type[KvTransferError]] = {
    grpc.StatusCode.NOT_FOUND: KvTransferNotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: KvLayoutMismatchError,
    grpc.StatusCode.UNAVAILABLE: KvSourceUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: KvSourceUnavailableError,
    grpc.StatusCode.UNIMPLEMENTED: KvTransportUnavailableError,
}


class GrpcKvTransport(KvTransport):
    """Pulls over engine.proto's PullKv; `timeout_s` bounds a whole pull (None: no deadline).

    `dialer` is how this engine reaches the sources: TLS/mTLS and the bearer token of its
    --engine-tls-* / --engine-auth-token-file flags (`server_security.engine_dialer(config.security)`).
    """

    def __init__(
        self,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        dialer: EngineDialer = PLAINTEXT,
    ) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0 or None, got {timeout_s}")
        self._timeout_s = timeout_s
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._dialer = dialer

    async def pull(
        self, spec: KvPullSpec, sink: KvBlockSink, metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult:
        num_bytes = 0
        async with contextlib.aclosing(self.stream(spec, pull_request(spec), metadata)) as chunks:
            async for chunk in chunks:
                check_chunk(chunk, spec, len(chunk.data))
                if chunk.num_blocks:
                    await sink.write(chunk.first_block, chunk.num_blocks, chunk.data)
                num_bytes += len(chunk.data)
        return KvPullResult(num_blocks=spec.num_blocks, num_bytes=num_bytes)

    async def stream(
        self, spec: KvPullSpec, request: pb.PullKvRequest, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncIterator[pb.KvChunk]:
        """The chunks of one PullKv call, each the next run of the pull (other transports' control path
        too). Status codes become KvTransferErrors; the call is cancelled when the caller stops early;
        KvTransferError when the stream ends before block total_blocks."""
        stub = pb_grpc.EngineStub(self._channel(spec.source_address))
        call = stub.PullKv(request, timeout=self._timeout_s, metadata=self._dialer.metadata(*metadata))
        next_block = spec.start_block
        try:
            async for chunk in call:
                if chunk.first_block != next_block:
                    raise KvTransferError(
                        f"{_where(spec)}: chunk starts at block {chunk.first_block}, expected {next_block}"
                    )
                next_block += chunk.num_blocks
                yield chunk
        except grpc.aio.AioRpcError as exc:
            kind = _ERRORS.get(exc.code(), KvTransferError)
            raise kind(f"{_where(spec)}: {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()  # a no-op after the last chunk; stops the source when the sink or a check failed
        if next_block != spec.total_blocks:
            raise KvTransferError(
                f"{_where(spec)}: the stream ended at block {next_block} of {spec.total_blocks}"
            )

    async def described(
        self, spec: KvPullSpec, request: pb.PullKvRequest, metadata: Sequence[tuple[str, str]], field: str
    ) -> Any:
        """The descriptors of a pull answered in one chunk (NIXL reads, direct shared-memory copies): that
        chunk's `field` message, which covers blocks [start_block, total_blocks)."""
        found = None
        async with contextlib.aclosing(self.stream(spec, request, metadata)) as chunks:
            async for chunk in chunks:
                check_chunk(chunk, spec, chunk.num_blocks * spec.layout.block_bytes)
                if chunk.data or not chunk.HasField(field) or chunk.num_blocks != spec.num_blocks:
                    raise KvTransferError(f"PullKv {spec.transfer_id}: expected one chunk of {field} blocks")
                found = getattr(chunk, field)
        assert found is not None  # the stream reached total_blocks
        return found

    async def release_after(self, spec: KvPullSpec, what: str) -> None:
        """Release a pull whose blocks this side read itself (`what`: the NIXL read, the copy): released
        means they stayed pinned throughout; otherwise KvTransferError."""
        if not await self.release(spec.source_address, spec.transfer_id):
            raise KvTransferError(
                f"PullKv {spec.transfer_id}: the transfer ended during {what} (its lease ran out); "
                "the blocks read may have been reused"
            )

    async def release(self, source_address: str, transfer_id: str) -> bool:
        stub = pb_grpc.EngineStub(self._channel(source_address))
        try:
            request = pb.ReleaseKvRequest(transfer_id=transfer_id)
            reply = await stub.ReleaseKv(request, timeout=self._timeout_s, metadata=self._dialer.metadata())
        except grpc.aio.AioRpcError as exc:
            kind = _ERRORS.get(exc.code(), KvTransferError)
            where = f"ReleaseKv {transfer_id} at {source_address}"
            raise kind(f"{where}: {exc.code().name}: {exc.details()}") from None
        return reply.released

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._dialer.dial(address, self._options)
            self._channels[address] = channel
        return channel


def pull_request(
    spec: KvPullSpec, transport: pb.KvTransportKind.ValueType = pb.KV_TRANSPORT_GRPC, **fields: object
) -> pb.PullKvRequest:
    """The PullKv request of `spec` over `transport` (with its fields: shm_segment, nixl_known_agents)."""
    return pb.PullKvRequest(
        transfer_id=spec.transfer_id,
        start_block=spec.start_block,
        layout_fingerprint=spec.layout.fingerprint,
        transport=transport,
        **fields,  # type: ignore[arg-type]
    )


def _where(spec: KvPullSpec) -> str:
    return f"PullKv {spec.transfer_id} from {spec.source_address}"


def check_chunk(chunk: pb.KvChunk, spec: KvPullSpec, payload_bytes: int) -> None:
    """Raise KvTransferError unless `chunk` (already the next run of the pull) stays inside the pull and
    its payload (`payload_bytes`: in the message, or in a segment) has its size."""
    problem = None
    if chunk.total_blocks != spec.total_blocks:
        problem = f"the source has {chunk.total_blocks} blocks, the handle {spec.total_blocks}"
    elif chunk.first_block + chunk.num_blocks > spec.total_blocks:
        problem = f"chunk runs past block {spec.total_blocks}"
    elif chunk.num_blocks == 0 and chunk.first_block != spec.total_blocks:
        problem = f"an empty chunk at block {chunk.first_block}"
    elif payload_bytes != chunk.num_blocks * spec.layout.block_bytes:
        problem = (
            f"{chunk.num_blocks} blocks in {payload_bytes} bytes, expected {spec.layout.block_bytes} each"
        )
    if problem is not None:
        raise KvTransferError(f"{_where(spec)}: {problem}")
