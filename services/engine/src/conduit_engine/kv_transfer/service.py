"""The source engine's PullKv and ReleaseKv handlers (engine.proto), for EngineServicer to delegate to.

PullKv starts a pull in the registry (so the blocks stay pinned however the transfer ends meanwhile),
streams the requested blocks in chunks of whole blocks of at most `chunk_bytes` (4 MiB by default: far
below the 64 MiB message limit, small enough to interleave with other streams), and finishes the pull:
completed after the last chunk was handed to gRPC, failed if the puller went away or anything broke.

The registry belongs to the engine loop thread: every registry call goes through `run_on_engine`
(AsyncEngine.run_sync in the engine) as a task that finishes even when the RPC is cancelled, and a pull
whose start lands after its RPC was cancelled is finished too, so no pull is left holding its blocks.
Gathering runs in a worker thread: pinned blocks are not written (a worker-backed runner orders the
gather with its steps itself).

The request's `transport` picks how the blocks travel: KvChunk bytes (gRPC); the puller's shared-memory
segment, each chunk gathered straight into it and sent without data (shm, same host); or, for NIXL and
for direct shared-memory pulls (shm_direct), one chunk describing where the blocks lie in this engine's
registered or shared cache (for NIXL per tensor-parallel rank holding distinct KV heads, each rank's own
agent and memory): the puller reads them itself and releases the transfer (ReleaseKv), so that pull
leaves the transfer pending, its blocks pinned, until then or until the lease ends. A transport this
engine does not serve answers UNIMPLEMENTED.
Errors abort the call with their status code here (the same codes server.status_for gives them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.errors import InvalidRequestError
from conduit_engine.kv_transfer.cache_io import KvBlockStore
from conduit_engine.kv_transfer.errors import (
    KvLayoutMismatchError,
    KvTransferError,
    KvTransportUnavailableError,
)
from conduit_engine.kv_transfer.grpc_transport import DEFAULT_MAX_MESSAGE_BYTES
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.registry import KvTransfer, KvTransferRegistry
from conduit_engine.kv_transfer.shm_cache import SharedKvCacheFile
from conduit_engine.kv_transfer.shm_segment import ShmSegment

RunOnEngine = Callable[[Callable[[], Any]], Awaitable[Any]]


class NixlBlocksSource(Protocol):
    """This engine's NIXL-registered KV cache, as a source (nixl_agent.NixlKvEndpoint)."""

    def describe(self, block_ids: Sequence[int], known_agents: Sequence[str]) -> pb.KvNixlBlocks:
        """Where cache blocks `block_ids` lie, per rank holding distinct KV heads; each rank's agent
        metadata too unless the puller holds it already (its agent is one of `known_agents`)."""
        ...


DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# A shared-memory chunk's payload is in the segment, not the message: larger chunks, fewer messages
# (still several per long prompt, so the puller scatters one while the source gathers the next).
SHM_CHUNK_BYTES = 32 * 1024 * 1024
_MESSAGE_OVERHEAD = 64  # KvChunk's fields besides the payload, rounded up


def blocks_per_chunk(block_bytes: int, chunk_bytes: int) -> int:
    """Whole blocks per KvChunk: as many as fit in `chunk_bytes`, at least one."""
    return max(1, chunk_bytes // block_bytes)


def kv_status_code(exc: BaseException) -> grpc.StatusCode:
    """The status a KV transfer error travels as (for server.status_for, too)."""
    if isinstance(exc, KvTransferError):
        return grpc.StatusCode[exc.grpc_code]
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class KvTransferService:
    """PullKv / ReleaseKv over one engine's registry and KV cache."""

    def __init__(
        self,
        registry: KvTransferRegistry,
        store: KvBlockStore,
        layout: KvLayoutSpec,
        run_on_engine: RunOnEngine,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        serve_shm: bool = False,
        nixl: NixlBlocksSource | None = None,
        shm_chunk_bytes: int = SHM_CHUNK_BYTES,
        shm_cache: SharedKvCacheFile | None = None,
    ) -> None:
        """`serve_shm`: answer KV_TRANSPORT_SHM pulls (write into the puller's segment); `nixl`: this
        engine's registered cache, to answer KV_TRANSPORT_NIXL pulls with its blocks' descriptors;
        `shm_cache`: the memfd this engine's cache lives in, to answer direct shared-memory pulls."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: must be >= 1, got {chunk_bytes}")
        if layout.block_bytes + _MESSAGE_OVERHEAD > max_message_bytes:
            raise ValueError(
                f"kv block of {layout.block_bytes} bytes does not fit a {max_message_bytes}-byte gRPC message"
            )
        self._registry = registry
        self._store = store
        self._layout = layout
        self._run = run_on_engine
        self._tasks: set[asyncio.Future[Any]] = set()  # engine calls that outlive a cancelled RPC
        self._serve_shm = serve_shm
        self._nixl = nixl
        self._shm_cache = shm_cache if serve_shm else None
        limit = (max_message_bytes - _MESSAGE_OVERHEAD) // layout.block_bytes
        self.blocks_per_chunk = min(blocks_per_chunk(layout.block_bytes, chunk_bytes), limit)
        self.blocks_per_shm_chunk = blocks_per_chunk(layout.block_bytes, shm_chunk_bytes)

    async def pull_kv(
        self, request: pb.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvChunk]:
        """The PullKv handler."""
        try:
            async with contextlib.aclosing(self.chunks(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (KvTransferError, InvalidRequestError) as exc:
            await context.abort(kv_status_code(exc), str(exc))

    async def release_kv(
        self, request: pb.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseKvResponse:
        """The ReleaseKv handler."""
        if not request.transfer_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id: must not be empty")
        released = await asyncio.shield(self._spawn(lambda: self._registry.release(request.transfer_id)))
        return pb.ReleaseKvResponse(released=released)

    async def chunks(self, request: pb.PullKvRequest) -> AsyncIterator[pb.KvChunk]:
        """The chunks of one pull (raises KvTransferError / InvalidRequestError before or between them)."""
        self._check_request(request)
        transfer_id = request.transfer_id
        transfer = await self._start_pull(transfer_id)
        completed = False
        try:
            total = transfer.num_blocks
            if request.start_block > total:
                raise InvalidRequestError(
                    "start_block",
                    f"must be at most {total} (the transfer's blocks), got {request.start_block}",
                )
            if request.start_block == total:  # everything was a prefix-cache hit: say so, send nothing
                yield pb.KvChunk(first_block=total, num_blocks=0, total_blocks=total)
            elif request.transport == pb.KV_TRANSPORT_NIXL:
                # The puller reads the blocks itself and then releases the transfer (ReleaseKv): until
                # then they stay pinned, as after a pull that broke off.
                yield self._nixl_chunk(request, transfer)
                return
            elif request.transport == pb.KV_TRANSPORT_SHM and request.shm_direct:
                # As for NIXL: the puller copies out of this engine's cache, then calls ReleaseKv.
                yield self._shm_direct_chunk(request, transfer)
                return
            elif request.transport == pb.KV_TRANSPORT_SHM:
                async with contextlib.aclosing(self._shm_chunks(request, transfer)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            else:
                for first in range(request.start_block, total, self.blocks_per_chunk):
                    ids = transfer.block_ids[first : first + self.blocks_per_chunk]
                    data = await asyncio.to_thread(self._store.gather_kv_blocks, ids)
                    yield pb.KvChunk(first_block=first, num_blocks=len(ids), total_blocks=total, data=data)
            completed = True
        finally:
            await asyncio.shield(self._spawn(lambda: self._registry.finish_pull(transfer_id, completed)))

    async def _shm_chunks(self, request: pb.PullKvRequest, transfer: KvTransfer) -> AsyncIterator[pb.KvChunk]:
        """Gather each chunk's blocks straight into the puller's segment; the chunks carry no data."""
        if not self._serve_shm:
            raise KvTransportUnavailableError("transport: this engine does not serve shared-memory pulls")
        block_bytes, start, total = self._layout.block_bytes, request.start_block, transfer.num_blocks
        try:
            segment = ShmSegment.open(request.shm_segment, (total - start) * block_bytes)
        except ValueError as exc:
            raise InvalidRequestError("shm_segment", str(exc).removeprefix("shm_segment: ")) from None
        except OSError as exc:  # not in this engine's /dev/shm: another host or container after all
            raise KvTransportUnavailableError(
                f"shm_segment: cannot open {request.shm_segment}: {exc}"
            ) from None
        try:
            step = self.blocks_per_shm_chunk
            for first in range(start, total, step):
                ids = transfer.block_ids[first : first + step]
                offset = (first - start) * block_bytes
                out = segment.view[offset : offset + len(ids) * block_bytes]
                await asyncio.to_thread(self._store.gather_kv_blocks_into, ids, out)
                yield pb.KvChunk(first_block=first, num_blocks=len(ids), total_blocks=total)
        finally:
            segment.close()

    def _shm_direct_chunk(self, request: pb.PullKvRequest, transfer: KvTransfer) -> pb.KvChunk:
        if self._shm_cache is None:
            raise KvTransportUnavailableError(
                "shm_direct: this engine's KV cache is not in shared memory (only an engine whose cache "
                "lives in its own process on the CPU with --kv-transport shm shares it)"
            )
        start, total = request.start_block, transfer.num_blocks
        blocks = self._shm_cache.describe(transfer.block_ids[start:], self._layout.region_block_bytes)
        return pb.KvChunk(first_block=start, num_blocks=total - start, total_blocks=total, shm=blocks)

    def _nixl_chunk(self, request: pb.PullKvRequest, transfer: KvTransfer) -> pb.KvChunk:
        if self._nixl is None:
            raise KvTransportUnavailableError(
                "transport: this engine does not serve NIXL pulls (no agent: --kv-transport nixl)"
            )
        start, total = request.start_block, transfer.num_blocks
        known = [*request.nixl_known_agents, request.nixl_known_agent]
        blocks = self._nixl.describe(transfer.block_ids[start:], known)
        return pb.KvChunk(first_block=start, num_blocks=total - start, total_blocks=total, nixl=blocks)

    async def _start_pull(self, transfer_id: str) -> KvTransfer:
        started = self._spawn(lambda: self._registry.start_pull(transfer_id))

        def finish_orphan(task: asyncio.Future[Any]) -> None:
            if not task.cancelled() and task.exception() is None:
                self._spawn(lambda: self._registry.finish_pull(transfer_id, False))

        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            started.add_done_callback(finish_orphan)  # the start may still happen: end that pull then
            raise

    def _spawn(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn` through run_on_engine as a task of its own, kept until done."""
        task = asyncio.ensure_future(self._run(fn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_request(self, request: pb.PullKvRequest) -> None:
        if not request.transfer_id:
            raise InvalidRequestError("transfer_id", "must not be empty")
        if not request.layout_fingerprint:
            raise InvalidRequestError("layout_fingerprint", "must not be empty")
        if request.layout_fingerprint != self._layout.fingerprint:
            raise KvLayoutMismatchError(
                f"layout_fingerprint: {request.layout_fingerprint} differs from this engine's "
                f"{self._layout.fingerprint} ({self._layout})"
            )
