"""The decode side on the event loop: one pull of a consume request, through a KvTransport, into this
engine's cache blocks (its runner, a KvBlockStore).

A pull never fails its request: every transfer error is logged and reported as None, and the engine then
recomputes the prompt itself. After a failure other than NOT_FOUND (the source may still pin the blocks,
say a pull broken midway) the source is asked to release the transfer at once rather than at its lease's
end. Cancellation (the request was aborted) propagates; the transport stops the source's stream.

The transport of each pull follows this engine's --kv-transport and the handle: shared memory when both
engines serve it and share a host (equal shm_host), NIXL when both have an agent, else gRPC; a pull whose
transport turns out unusable (KvTransportUnavailableError: a segment the source cannot open, a source
without NIXL) is pulled again over gRPC. Transports are made on first use: their channels belong to the
event loop that made them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from conduit_common.engine_dialer import EngineDialer
from conduit_engine.kv_transfer.cache_io import CacheBlockWriter, KvBlockStore
from conduit_engine.kv_transfer.errors import (
    KvTransferError,
    KvTransferNotFoundError,
    KvTransportUnavailableError,
)
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport
from conduit_engine.kv_transfer.nixl_transport import NixlKvTransport
from conduit_engine.kv_transfer.params import SourceTransports
from conduit_engine.kv_transfer.setup import KvTransports
from conduit_engine.kv_transfer.shm_transport import ShmKvTransport
from conduit_engine.kv_transfer.transport import KvPullResult, KvPullSpec, KvTransport

log = logging.getLogger(__name__)


class KvPuller:
    """Pulls transfers into `store`'s blocks; one per engine, used from one event loop."""

    def __init__(
        self,
        store: KvBlockStore,
        timeout_s: float,
        max_message_bytes: int | None,
        dialer: EngineDialer,
        transports: KvTransports | None = None,
    ) -> None:
        self._store = store
        self._options: dict[str, object] = {"timeout_s": timeout_s, "dialer": dialer}
        if max_message_bytes is not None:
            self._options["max_message_bytes"] = max_message_bytes
        self._local = transports or KvTransports("grpc", SourceTransports())
        self._transports: dict[str, KvTransport] = {}
        self.pulls_by_transport: dict[str, int] = {}  # completed pulls, by the transport that moved them

    @property
    def transport(self) -> KvTransport:
        """The gRPC transport (every pull's fallback, and ReleaseKv)."""
        return self.transport_for("grpc")

    def choose(self, spec: KvPullSpec) -> str:
        """The transport a pull of `spec` goes over: grpc, shm or nixl."""
        mine, theirs = self._local.offered, spec.transports
        if mine.shm_host and theirs.shm_host == mine.shm_host:
            return "shm"
        if mine.nixl and theirs.nixl and self._local.nixl is not None:
            return "nixl"
        return "grpc"

    async def pull(
        self, spec: KvPullSpec, dest_block_ids: Sequence[int], metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult | None:
        """Pull `spec`'s blocks into `dest_block_ids`; None when the transfer failed (logged). `metadata`:
        more of the pull's call metadata (its trace context)."""
        try:
            kind = self.choose(spec)
            try:
                result = await self.transport_for(kind).pull(
                    spec, self._writer(spec, dest_block_ids), metadata
                )
            except KvTransportUnavailableError as exc:
                if kind == "grpc":
                    raise
                log.warning(
                    "KV pull %s over %s is not possible, pulling over gRPC: %s", spec.transfer_id, kind, exc
                )
                kind = "grpc"
                result = await self.transport.pull(spec, self._writer(spec, dest_block_ids), metadata)
            self.pulls_by_transport[kind] = self.pulls_by_transport.get(kind, 0) + 1
            return result
        except KvTransferError as exc:
            log.warning("KV pull %s failed, recomputing the prompt: %s", spec.transfer_id, exc)
            if not isinstance(exc, KvTransferNotFoundError):
                await self._release(spec)
        except Exception:  # a bug in a transport or a sink: still only a recompute for the request
            log.exception("KV pull %s failed, recomputing the prompt", spec.transfer_id)
            await self._release(spec)
        return None

    async def _release(self, spec: KvPullSpec) -> None:
        try:
            await self.transport.release(spec.source_address, spec.transfer_id)
        except KvTransferError as exc:
            log.info("ReleaseKv %s failed (its lease frees it): %s", spec.transfer_id, exc)

    def _writer(self, spec: KvPullSpec, dest_block_ids: Sequence[int]) -> CacheBlockWriter:
        return CacheBlockWriter(self._store, spec.layout.block_bytes, dest_block_ids, spec.start_block)

    def transport_for(self, kind: str) -> KvTransport:
        """The transport of that kind (made on first use)."""
        transport = self._transports.get(kind)
        if transport is None:
            if kind == "shm":
                transport = ShmKvTransport(caches=self._local.caches, **self._options)
            elif kind == "nixl":
                transport = NixlKvTransport(self._local.nixl, **self._options)
            else:
                transport = GrpcKvTransport(**self._options)  # type: ignore[arg-type]
            self._transports[kind] = transport
        return transport

    async def close(self) -> None:
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            await transport.close()
