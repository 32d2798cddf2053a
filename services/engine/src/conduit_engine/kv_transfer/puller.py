"""The decode side on the event loop: one pull of a consume request, through a KvTransport, into this
engine's cache blocks (its runner, a KvBlockStore).

A pull never fails its request: every transfer error is logged and reported as None, and the engine then
recomputes the prompt itself. After a failure other than NOT_FOUND (the source may still pin the blocks,
say a pull broken midway) the source is asked to release the transfer at once rather than at its lease's
end. Cancellation (the request was aborted) propagates; the transport stops the source's stream.

The transport is made on first use: its channels belong to the event loop that made them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from conduit_common.engine_dialer import EngineDialer
from conduit_engine.kv_transfer.cache_io import CacheBlockWriter, KvBlockStore
from conduit_engine.kv_transfer.errors import KvTransferError, KvTransferNotFoundError
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport
from conduit_engine.kv_transfer.transport import KvPullResult, KvPullSpec, KvTransport

log = logging.getLogger(__name__)


class KvPuller:
    """Pulls transfers into `store`'s blocks; one per engine, used from one event loop."""

    def __init__(
        self, store: KvBlockStore, timeout_s: float, max_message_bytes: int | None, dialer: EngineDialer
    ) -> None:
        self._store = store
        self._options: dict[str, object] = {"timeout_s": timeout_s, "dialer": dialer}
        if max_message_bytes is not None:
            self._options["max_message_bytes"] = max_message_bytes
        self._transport: KvTransport | None = None

    @property
    def transport(self) -> KvTransport:
        if self._transport is None:
            self._transport = GrpcKvTransport(**self._options)  # type: ignore[arg-type]
        return self._transport

    async def pull(
        self, spec: KvPullSpec, dest_block_ids: Sequence[int], metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult | None:
        """Pull `spec`'s blocks into `dest_block_ids`; None when the transfer failed (logged). `metadata`:
        more of the pull's call metadata (its trace context)."""
        writer = CacheBlockWriter(self._store, spec.layout.block_bytes, dest_block_ids, spec.start_block)
        try:
            return await self.transport.pull(spec, writer, metadata)
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

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()
            self._transport = None
