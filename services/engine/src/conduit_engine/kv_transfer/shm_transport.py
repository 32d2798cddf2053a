"""KvTransport through shared memory, between engines on one host (--kv-transport shm).

The puller makes a segment of the pull's size (shm_segment.ShmSegment), names it in a PullKv request
with transport KV_TRANSPORT_SHM, and the source gathers each chunk's blocks straight into it and sends
the chunk without data; the puller scatters each chunk from the segment into its cache blocks as it
arrives (the sink reads the mapped memory in place: no bytes object on either side). The segment is
unlinked when the pull ends, however it ends. The control path (ordering, checks, status codes, the
call's cancellation, ReleaseKv) is GrpcKvTransport's; a segment that cannot be made, or that the source
cannot open, is KvTransportUnavailableError (the puller then pulls over gRPC).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.kv_transfer.errors import KvTransferError, KvTransportUnavailableError
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport, check_chunk, pull_request
from conduit_engine.kv_transfer.shm_segment import ShmSegment
from conduit_engine.kv_transfer.transport import KvBlockSink, KvPullResult, KvPullSpec


class ShmKvTransport(GrpcKvTransport):
    """Pulls through a shared-memory segment per pull (same options as GrpcKvTransport)."""

    async def pull(
        self, spec: KvPullSpec, sink: KvBlockSink, metadata: Sequence[tuple[str, str]] = ()
    ) -> KvPullResult:
        if spec.num_blocks == 0:  # nothing to move: the plain call says so
            return await super().pull(spec, sink, metadata)
        block_bytes = spec.layout.block_bytes
        size = spec.num_blocks * block_bytes
        try:
            segment = ShmSegment.create(size)
        except OSError as exc:
            raise KvTransportUnavailableError(f"no shared-memory segment of {size} bytes: {exc}") from None
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
        return KvPullResult(num_blocks=spec.num_blocks, num_bytes=size)
