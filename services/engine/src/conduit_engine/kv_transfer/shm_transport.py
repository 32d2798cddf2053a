"""KvTransport through shared memory, between engines on one host (--kv-transport shm).

The puller makes a segment of the pull's size (shm_segment.ShmSegment), names it in a PullKv request
with transport KV_TRANSPORT_SHM, and the source gathers each chunk's blocks straight into it and sends
the chunk without data; the puller scatters each chunk from the segment into its cache blocks as it
arrives (the sink reads the mapped memory in place: no bytes object on either side). The segment is
unlinked when the pull ends, however it ends; the next pull's segment is made ahead of it. The control
path (ordering, checks, status codes, the
call's cancellation, ReleaseKv) is GrpcKvTransport's; a segment that cannot be made, or that the source
cannot open, is KvTransportUnavailableError (the puller then pulls over gRPC).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransferError, KvTransportUnavailableError
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport, check_chunk, pull_request
from conduit_engine.kv_transfer.shm_segment import ShmSegment
from conduit_engine.kv_transfer.transport import KvBlockSink, KvPullResult, KvPullSpec


class ShmKvTransport(GrpcKvTransport):
    """Pulls through a shared-memory segment per pull (same options as GrpcKvTransport).

    Making a segment (the kernel zeroes its pages) costs about as much as the copy itself, so after each
    pull one segment of that pull's size is made ahead, in a worker thread, for the next one. It has not
    been named to any source until that pull uses it, and each segment serves one pull only (a source
    still writing after a cancelled pull can only reach a segment nobody reads any more). `close`
    unlinks it.
    """

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self._spare: asyncio.Future[ShmSegment] | None = None

    async def pull(
        self, spec: KvPullSpec, sink: KvBlockSink, metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult:
        if spec.num_blocks == 0:  # nothing to move: the plain call says so
            return await super().pull(spec, sink, metadata)
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

    async def close(self) -> None:
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
