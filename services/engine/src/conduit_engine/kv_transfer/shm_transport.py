"""KvTransport through shared memory, between engines on one host (--kv-transport shm).

Direct, when this engine's cache lives in its process (`caches`) and the source's in a memfd
(shm_cache): a PullKv request with `shm_direct` is answered by one chunk saying where the blocks lie in
the source's cache; the puller maps that cache read-only (once per source), copies each run of blocks
straight into its destination blocks (one copy, in a worker thread) and calls ReleaseKv, as NIXL does:
released means the blocks stayed pinned through the copy. A source whose cache is not shared answers
UNIMPLEMENTED and is pulled from through segments from then on, as is one whose cache cannot be opened.

Through a segment otherwise: the puller makes a segment of the pull's size (shm_segment.ShmSegment),
names it in a PullKv request with transport KV_TRANSPORT_SHM, and the source gathers each chunk's blocks
straight into it and sends the chunk without data; the puller scatters each chunk from the segment into
its cache blocks as it arrives (the sink reads the mapped memory in place: no bytes object on either
side). The segment is unlinked when the pull ends, however it ends; the next pull's segment is made
ahead of it.

The control path (ordering, checks, status codes, the call's cancellation, ReleaseKv) is
GrpcKvTransport's; a segment that cannot be made, or that the source cannot open, is
KvTransportUnavailableError (the puller then pulls over gRPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransferError, KvTransportUnavailableError
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport, check_chunk, pull_request
from conduit_engine.kv_transfer.shm_cache import MAPPED_IDLE_S, MappedKvSources, copy_blocks
from conduit_engine.kv_transfer.shm_segment import ShmSegment
from conduit_engine.kv_transfer.transport import KvBlockSink, KvPullResult, KvPullSpec

log = logging.getLogger(__name__)

# Threads that copy one direct pull (shm_cache.copy_blocks): one per core, up to four.
COPY_THREADS = min(4, os.cpu_count() or 1)


class ShmKvTransport(GrpcKvTransport):
    """Pulls through a shared-memory segment per pull (same options as GrpcKvTransport).

    Making a segment (the kernel zeroes its pages) costs about as much as the copy itself, so after each
    pull one segment of that pull's size is made ahead, in a worker thread, for the next one. It has not
    been named to any source until that pull uses it, and each segment serves one pull only (a source
    still writing after a cancelled pull can only reach a segment nobody reads any more). `close`
    unlinks it.
    """

    def __init__(self, caches: Sequence[Any] | None = None, **options: Any) -> None:
        """`caches`: this engine's cache tensors (layer 0's K, V, layer 1's K, ...) when they live in
        this process: pulls then copy straight out of sources whose cache is shared."""
        super().__init__(**options)
        self._spare: asyncio.Future[ShmSegment] | None = None
        self._caches = caches
        self._mapped = MappedKvSources()
        self._sweeping: asyncio.TimerHandle | None = None
        self._segments_only: set[str] = set()  # sources whose cache is not shared, or not ours to open

    async def pull(
        self, spec: KvPullSpec, sink: KvBlockSink, metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult:
        if spec.num_blocks == 0:  # nothing to move: the plain call says so
            return await super().pull(spec, sink, metadata)
        destination = getattr(sink, "destination_blocks", None)
        if self._caches is not None and destination is not None:
            if spec.source_address not in self._segments_only:
                try:
                    return await self._pull_direct(spec, sink, destination(), metadata)
                except KvTransportUnavailableError as exc:
                    log.info("KV pulls from %s go through segments: %s", spec.source_address, exc)
                    self._segments_only.add(spec.source_address)
        return await self._pull_segment(spec, sink, metadata)

    async def _pull_direct(
        self,
        spec: KvPullSpec,
        sink: KvBlockSink,
        dest_block_ids: Sequence[int],
        metadata: Sequence[tuple[str, str]],
    ) -> KvPullResult:
        request = pull_request(spec, pb.KV_TRANSPORT_SHM, shm_direct=True)
        blocks: pb.KvShmBlocks = await self.described(spec, request, metadata, "shm")
        if len(blocks.block_ids) != spec.num_blocks:
            raise KvTransferError(
                f"PullKv {spec.transfer_id}: {len(blocks.block_ids)} block ids for {spec.num_blocks} blocks"
            )
        # A cache that cannot be opened is KvTransportUnavailableError: the transfer is still pending
        # (this pull left it so), and the segment path pulls it again.
        source = self._mapped.acquire(spec.source_address, blocks)
        assert self._caches is not None
        # The copy writes destination blocks: it runs to its end even when the pull is cancelled.
        copy = asyncio.get_running_loop().run_in_executor(
            None, copy_blocks, source, blocks, self._caches, dest_block_ids, COPY_THREADS
        )
        copy.add_done_callback(lambda _: self._mapped.release(source))
        try:
            num_bytes = await asyncio.shield(copy)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await copy
            raise
        sink.written_directly(spec.num_blocks)  # type: ignore[attr-defined]
        self._sweep_later()
        await self.release_after(spec, "the copy")
        return KvPullResult(num_blocks=spec.num_blocks, num_bytes=num_bytes)

    async def _pull_segment(
        self, spec: KvPullSpec, sink: KvBlockSink, metadata: Sequence[tuple[str, str]]
    ) -> KvPullResult:
        block_bytes = spec.layout.block_bytes
        size = spec.num_blocks * block_bytes
        segment = await self._segment(size)
        try:
            request = pull_request(spec, pb.KV_TRANSPORT_SHM, shm_segment=segment.name)
            async with contextlib.aclosing(self.stream(spec, request, metadata)) as chunks:
                async for chunk in chunks:
                    if chunk.data:
                        raise KvTransferError(
                            f"PullKv {spec.transfer_id}: a shared-memory chunk carries data"
                        )
                    check_chunk(chunk, spec, chunk.num_blocks * block_bytes)
                    if chunk.num_blocks:
                        offset = (chunk.first_block - spec.start_block) * block_bytes
                        payload = segment.view[offset : offset + chunk.num_blocks * block_bytes]
                        await sink.write(chunk.first_block, chunk.num_blocks, payload)
        finally:
            segment.close()
            if self._spare is None:  # submitted to a worker thread now, not when the loop next runs
                self._spare = asyncio.get_running_loop().run_in_executor(None, ShmSegment.create, size)
        return KvPullResult(num_blocks=spec.num_blocks, num_bytes=size)

    def _sweep_later(self) -> None:
        """Unmap sources that are gone or idle, now and every so often while any stays mapped."""
        self._mapped.sweep()
        if self._sweeping is None and len(self._mapped):
            self._sweeping = asyncio.get_running_loop().call_later(MAPPED_IDLE_S / 4, self._swept)

    def _swept(self) -> None:
        self._sweeping = None
        self._sweep_later()

    async def close(self) -> None:
        if self._sweeping is not None:
            self._sweeping.cancel()
            self._sweeping = None
        self._mapped.close()
        spare, self._spare = self._spare, None
        if spare is not None:
            with contextlib.suppress(OSError):
                (await spare).close()
        await super().close()

    async def _segment(self, size: int) -> ShmSegment:
        """The segment made ahead when it is large enough (else it is dropped), or a new one."""
        spare, self._spare = self._spare, None
        if spare is not None:
            try:
                segment: ShmSegment | None = await _made(spare)
            except OSError:
                segment = None
            if segment is not None and segment.size >= size:
                return segment
            if segment is not None:
                segment.close()
        try:
            return await _made(asyncio.get_running_loop().run_in_executor(None, ShmSegment.create, size))
        except OSError as exc:
            raise KvTransportUnavailableError(f"no shared-memory segment of {size} bytes: {exc}") from None


async def _made(task: asyncio.Future[ShmSegment]) -> ShmSegment:
    """The segment `task` makes; if the pull is cancelled meanwhile, the segment is closed once made."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_close_made)
        raise


def _close_made(task: asyncio.Future[ShmSegment]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()
