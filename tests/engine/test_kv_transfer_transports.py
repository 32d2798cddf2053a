"""Every KV transport end to end over a real grpc.aio server on 127.0.0.1: gRPC bytes, shared memory (the
puller's segment in /dev/shm) and NIXL (UCX reads between two agents' registered caches), each pulled
into a second cache through CacheBlockWriter.

Per transport: the bytes round-trip exactly into scattered destination blocks from a start_block; a
released or expired transfer is NOT_FOUND; a source that is down is UNAVAILABLE; a pull cancelled midway
leaves the transfer pending on the source, and a second pull completes it; every test
ends with no block held on the source (its registry and BlockManager checked) and no segment left in
/dev/shm. A source that does not
serve the transport asked for answers UNIMPLEMENTED, and the engine's puller then pulls over gRPC.
The NIXL cases skip where NIXL cannot start (the reason is printed), except in CI, where they must run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_common.engine_dialer import PLAINTEXT
from conduit_engine.kv_transfer.cache_io import CacheBlockWriter
from conduit_engine.kv_transfer.errors import (
    KvSourceUnavailableError,
    KvTransferError,
    KvTransferNotFoundError,
    KvTransportUnavailableError,
)
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport
from conduit_engine.kv_transfer.nixl_agent import NixlKvEndpoint
from conduit_engine.kv_transfer.nixl_transport import NixlKvTransport
from conduit_engine.kv_transfer.params import SourceTransports
from conduit_engine.kv_transfer.puller import KvPuller
from conduit_engine.kv_transfer.setup import KvTransports, start_transports
from conduit_engine.kv_transfer.shm_cache import (
    MappedKvSource,
    MappedKvSources,
    SharedKvCacheFile,
    block_runs,
    copy_blocks,
    split_moves,
)
from conduit_engine.kv_transfer.shm_segment import shm_host_id
from conduit_engine.kv_transfer.shm_transport import ShmKvTransport
from conduit_engine.kv_transfer.transport import KvPullSpec
from conduit_engine.ops.torch_ops import TorchOps
from tests.engine.test_kv_transfer_grpc import (
    LEASE,
    NUM_BLOCKS,
    Source,
    assert_blocks_equal,
    caches,
    shared_copy,
)
from tests.support.kv_blocks import (
    LocalKvBlocks,
    layout_of,
    nixl_endpoint_or_skip,
    pull_spec_for,
    shm_segments,
)

# Makes KV segments in /dev/shm: one such module at a time (tests/conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kv_shm_exclusive")]

TRANSPORTS = ["grpc", "shm", "shm-direct", "nixl"]


class Pair:
    """A source serving `kind` and a destination cache with that kind's transport."""

    def __init__(self, kind: str, dtype: torch.dtype = torch.float32) -> None:
        self.kind = kind
        self.gate = threading.Event()  # open; a test closes it to hold the source's gathers after the first
        self.gate.set()
        self.source = Source(dtype, chunk_blocks=2, transport=kind, gate=self.gate)
        self.dst_kv = caches(dtype, seed=None)
        self.dst_nixl: NixlKvEndpoint | None = None
        if kind == "nixl":
            self.dst_nixl = nixl_endpoint_or_skip(self.dst_kv)
            self.transport = NixlKvTransport(self.dst_nixl, timeout_s=30)
        elif kind == "shm":
            self.transport = ShmKvTransport(timeout_s=30)
        elif kind == "shm-direct":  # this cache in the process: copies straight out of the source's
            self.transport = ShmKvTransport(caches=flat(self.dst_kv), timeout_s=30)
        else:
            self.transport = GrpcKvTransport(timeout_s=30)

    def writer(self, dest_block_ids, start_block: int) -> CacheBlockWriter:
        block_bytes = self.source.layout.block_bytes
        return CacheBlockWriter(
            LocalKvBlocks(TorchOps(), self.dst_kv), block_bytes, dest_block_ids, start_block
        )

    def spec(self, transfer, start_block: int = 0) -> KvPullSpec:
        return pull_spec_for(self.source.handle(transfer), self.source.layout, start_block)

    async def close(self) -> None:
        self.gate.set()
        await self.transport.close()
        await self.source.server.stop(None)
        for endpoint in (self.source.nixl, self.dst_nixl):
            if endpoint is not None:
                endpoint.close()


def flat(kv) -> list[torch.Tensor]:
    return [cache for pair in kv for cache in pair]


async def until(condition, what: str) -> None:
    for _ in range(3000):  # the server sees a cancellation on its own loop turn
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


@pytest.fixture(params=TRANSPORTS)
async def pair(request):
    before = shm_segments()
    p = Pair(request.param)
    await p.source.server.start()
    yield p
    await p.close()
    p.source.registry.check_integrity()
    p.source.bm.check_integrity([])
    assert shm_segments() - before == set(), "a pull left its shared-memory segment behind"


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
async def test_a_pull_round_trips_the_bytes_exactly_into_scattered_blocks(kind, dtype):
    before = shm_segments()
    p = Pair(kind, dtype)
    await p.source.server.start()
    try:
        prompt = list(range(100, 123))  # 23 tokens: 6 blocks, the last partly filled
        transfer = p.source.produce(prompt)
        dest = [9, 3, 4, 12, 7]  # transfer blocks 1..5 (block 0 was a prefix-cache hit here)
        writer = p.writer(dest, start_block=1)
        result = await p.transport.pull(p.spec(transfer, 1), writer)
        assert (result.num_blocks, result.num_bytes) == (5, 5 * p.source.layout.block_bytes)
        assert writer.blocks_written == 5
        assert_blocks_equal(p.source.kv, transfer.block_ids[1:], p.dst_kv, dest)
        untouched = [b for b in range(NUM_BLOCKS) if b not in dest]
        assert all(not k[untouched].any() and not v[untouched].any() for k, v in p.dst_kv)
        # Completed (NIXL: released after its read): nothing pinned, the id is gone.
        assert p.source.bm.stats().used == 0 and p.source.registry.num_pending == 0
        with pytest.raises(KvTransferNotFoundError, match="NOT_FOUND"):
            await p.transport.pull(p.spec(transfer, 1), p.writer(dest, 1))
    finally:
        await p.close()
    p.source.bm.check_integrity([])
    assert shm_segments() - before == set()


async def test_released_and_expired_transfers_are_not_found_and_hold_nothing(pair):
    released = pair.source.produce([1, 2, 3, 4, 5])
    assert pair.source.registry.release(released.transfer_id)
    expired = pair.source.produce([6, 7, 8, 9, 10])
    pair.source.clock.now += LEASE
    for transfer in (released, expired):
        writer = pair.writer([0, 1], 0)
        with pytest.raises(KvTransferNotFoundError, match="NOT_FOUND"):
            await pair.transport.pull(pair.spec(transfer), writer)
        assert writer.blocks_written == 0
    assert pair.source.bm.stats().used == 0 and pair.source.registry.num_pending == 0


async def test_a_source_that_is_down_is_unavailable(pair):
    await pair.source.server.stop(None)
    transfer = pair.source.produce(list(range(8)))
    with pytest.raises(KvSourceUnavailableError, match="UNAVAILABLE"):
        await pair.transport.pull(pair.spec(transfer), pair.writer([0, 1], 0))
    pair.source.clock.now += LEASE  # the decode engine recomputes; the lease frees the source's blocks
    assert pair.source.registry.expire_due() == [transfer.transfer_id]


class StalledWriter(CacheBlockWriter):
    """Fault injection: the destination stalls after its first chunk until the pull is cancelled."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stalled = asyncio.Event()

    async def write(self, first_block: int, num_blocks: int, data) -> None:
        await super().write(first_block, num_blocks, data)
        self.stalled.set()
        await asyncio.Event().wait()


async def test_a_pull_cancelled_midway_leaves_the_transfer_pullable_then_it_completes(pair, monkeypatch):
    prompt = list(range(200, 220))  # 5 blocks, chunks of 2
    transfer = pair.source.produce(prompt)
    block_bytes = pair.source.layout.block_bytes
    stalled = asyncio.Event()
    if pair.kind == "nixl":  # no sink writes: cancel while the read is in flight
        endpoint = pair.dst_nixl
        read = endpoint.read

        async def read_then_stall(*args):
            result = await read(*args)
            stalled.set()
            await asyncio.Event().wait()
            return result

        monkeypatch.setattr(endpoint, "read", read_then_stall)
        writer = pair.writer(range(5), 0)
    elif pair.kind == "shm-direct":  # no sink writes: cancel between the copy and the release
        release = pair.transport.release

        async def stall_before_release(*args):
            stalled.set()
            await asyncio.Event().wait()
            return await release(*args)

        monkeypatch.setattr(pair.transport, "release", stall_before_release)
        writer = pair.writer(range(5), 0)
    else:
        writer = StalledWriter(LocalKvBlocks(TorchOps(), pair.dst_kv), block_bytes, range(5), 0)
        stalled = writer.stalled
    pair.gate.clear()  # gRPC, shm: the source's second chunk waits until the cancel reached it
    task = asyncio.ensure_future(pair.transport.pull(pair.spec(transfer), writer))
    await asyncio.wait_for(stalled.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    registry = pair.source.registry
    await until(
        lambda: registry.transfer(transfer.transfer_id).active_pulls == 0, "the source saw the cancel"
    )
    pair.gate.set()
    assert registry.num_pending == 1 and pair.source.bm.stats().pinned == 5
    registry.check_integrity()
    monkeypatch.undo()
    writer = pair.writer(range(5), 0)
    assert (await pair.transport.pull(pair.spec(transfer), writer)).num_blocks == 5
    assert_blocks_equal(pair.source.kv, transfer.block_ids, pair.dst_kv, range(5))
    assert pair.source.bm.stats().used == 0 and registry.num_pending == 0


@pytest.mark.parametrize("kind", ["shm", "nixl"])
async def test_a_source_not_serving_the_transport_is_unimplemented_and_the_puller_falls_back(kind):
    source = Source(torch.float32)  # gRPC only
    await source.server.start()
    dst_kv = caches(torch.float32, seed=None)
    dst_nixl = nixl_endpoint_or_skip(dst_kv) if kind == "nixl" else None
    transport = NixlKvTransport(dst_nixl, timeout_s=30) if dst_nixl else ShmKvTransport(timeout_s=30)
    offered = (
        SourceTransports(nixl=True) if kind == "nixl" else SourceTransports(shm_host=shm_host_id() or "")
    )
    puller = KvPuller(
        LocalKvBlocks(TorchOps(), dst_kv),
        30,
        None,
        PLAINTEXT,
        KvTransports(kind, offered, dst_nixl),
    )
    try:
        transfer = source.produce(list(range(30, 42)))  # 3 blocks
        handle_claims = SourceTransports(shm_host=shm_host_id() or "", nixl=True)
        spec = pull_spec_for(source.handle(transfer), source.layout, 0)
        spec = KvPullSpec(
            spec.source_address, spec.transfer_id, 0, spec.total_blocks, spec.layout, handle_claims
        )
        block_bytes = source.layout.block_bytes
        writer = CacheBlockWriter(LocalKvBlocks(TorchOps(), dst_kv), block_bytes, [5, 6, 7], 0)
        with pytest.raises(
            KvTransportUnavailableError, match="UNIMPLEMENTED: transport: this engine does not"
        ):
            await transport.pull(spec, writer)
        assert source.registry.num_pending == 1 and source.bm.stats().pinned == 3
        assert puller.choose(spec) == kind
        result = await puller.pull(spec, [5, 6, 7])
        assert result is not None and result.num_blocks == 3
        assert puller.pulls_by_transport == {"grpc": 1}
        assert_blocks_equal(source.kv, transfer.block_ids, dst_kv, [5, 6, 7])
        assert source.bm.stats().used == 0 and source.registry.num_pending == 0
    finally:
        await transport.close()
        await puller.close()
        await source.server.stop(None)
        if dst_nixl is not None:
            dst_nixl.close()


def test_the_puller_takes_shared_memory_only_on_the_same_host_and_nixl_only_when_both_have_it():
    kv = caches(torch.float32, seed=None)
    layout = layout_of("m", kv)
    here = SourceTransports(shm_host="boot:1:2")

    def choose(local: KvTransports, source: SourceTransports) -> str:
        puller = KvPuller(LocalKvBlocks(TorchOps(), kv), 30, None, PLAINTEXT, local)
        return puller.choose(KvPullSpec("h:1", "t", 0, 1, layout, source))

    shm, grpc_only = KvTransports("shm", here), KvTransports("grpc", SourceTransports())
    nixl = KvTransports("nixl", SourceTransports(nixl=True), nixl=object())
    assert choose(shm, here) == "shm"
    assert choose(shm, SourceTransports(shm_host="other-boot:1:2")) == "grpc"  # another host or container
    assert choose(shm, SourceTransports()) == "grpc"  # the source does not serve shared memory
    assert choose(grpc_only, here) == "grpc"  # this engine does not
    assert choose(nixl, SourceTransports(nixl=True)) == "nixl"
    assert choose(nixl, SourceTransports()) == "grpc"
    assert choose(grpc_only, SourceTransports(nixl=True)) == "grpc"


async def test_a_shared_memory_segment_must_be_one_of_ours_and_exist():
    source = Source(torch.float32, transport="shm")
    await source.server.start()
    try:
        transfer = source.produce(list(range(8)))
        stub = pb_grpc.EngineStub(grpc.aio.insecure_channel(source.address))
        cases = [
            ("../../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT, "shm_segment: expected conduit-kv-"),
            ("conduit-kv-" + "0" * 32, grpc.StatusCode.UNIMPLEMENTED, "shm_segment: cannot open conduit-kv-"),
        ]
        for name, code, message in cases:
            request = pb.PullKvRequest(
                transfer_id=transfer.transfer_id,
                layout_fingerprint=source.layout.fingerprint,
                transport=pb.KV_TRANSPORT_SHM,
                shm_segment=name,
            )
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                async for _ in stub.PullKv(request):
                    pass
            assert raw.value.code() == code and raw.value.details().startswith(message)
        assert source.registry.num_pending == 1 and source.registry.release(transfer.transfer_id)
    finally:
        await source.server.stop(None)
    source.bm.check_integrity([])


async def test_nixl_metadata_goes_only_to_a_puller_holding_a_live_transfer_id():
    source = Source(torch.float32, transport="nixl")
    await source.server.start()
    try:
        stub = pb_grpc.EngineStub(grpc.aio.insecure_channel(source.address))
        fingerprint = source.layout.fingerprint
        request = pb.PullKvRequest(
            transfer_id="guess", layout_fingerprint=fingerprint, transport=pb.KV_TRANSPORT_NIXL
        )
        chunks = []
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for chunk in stub.PullKv(request):
                chunks.append(chunk)
        assert raw.value.code() == grpc.StatusCode.NOT_FOUND and chunks == []
        transfer = source.produce(list(range(8)))
        request.transfer_id = transfer.transfer_id
        (chunk,) = [c async for c in stub.PullKv(request)]
        (rank,) = chunk.nixl.ranks  # one agent over every KV head
        assert rank.agent_name == source.nixl.name and rank.agent_metadata
        assert (rank.kv_head_start, rank.kv_head_count) == (0, source.layout.num_kv_heads)
        assert list(chunk.nixl.block_ids) == list(transfer.block_ids) and not chunk.data
        request.nixl_known_agents[:] = [source.nixl.name]  # the puller holds the metadata already
        (chunk,) = [c async for c in stub.PullKv(request)]
        assert chunk.nixl.ranks[0].agent_metadata == b""
        # A described pull is not a completed one: the blocks stay pinned until the puller releases.
        assert source.registry.num_pending == 1 and source.registry.release(transfer.transfer_id)
    finally:
        await source.server.stop(None)
        source.nixl.close()
    source.bm.check_integrity([])


async def test_a_lease_ending_during_a_nixl_read_fails_the_pull(monkeypatch):
    p = Pair("nixl")
    await p.source.server.start()
    try:
        transfer = p.source.produce(list(range(12)))
        read = p.dst_nixl.read

        async def read_past_the_lease(*args):
            result = await read(*args)
            p.source.clock.now += LEASE  # the source's loop frees the blocks: what was read may be stale
            assert p.source.registry.expire_due() == [transfer.transfer_id]
            return result

        monkeypatch.setattr(p.dst_nixl, "read", read_past_the_lease)
        with pytest.raises(KvTransferError, match="the transfer ended during the NIXL read"):
            await p.transport.pull(p.spec(transfer), p.writer([0, 1, 2], 0))
        assert p.source.bm.stats().used == 0 and p.source.registry.num_pending == 0
    finally:
        await p.close()


def test_a_transport_that_cannot_start_is_logged_with_its_reason_and_the_engine_runs_grpc(
    monkeypatch, caplog
):
    from conduit_engine.kv_transfer import nixl_agent

    caplog.set_level("INFO", logger="conduit_engine.kv_transfer.setup")
    kv = caches(torch.float32, seed=None)
    assert start_transports("grpc", SimpleNamespace(kv_caches=kv), 30).kind == "grpc"
    workers = start_transports("nixl", object(), 30)  # an executor with neither a cache nor workers
    assert (workers.kind, workers.offered, workers.nixl) == ("grpc", SourceTransports(), None)

    def missing():
        raise ImportError("NIXL is not importable (pip install --no-deps nixl-cu12): no module")

    monkeypatch.setattr(nixl_agent, "load_nixl", missing)
    assert start_transports("nixl", SimpleNamespace(kv_caches=kv), 30).kind == "grpc"
    monkeypatch.setattr("conduit_engine.kv_transfer.setup.shm_host_id", lambda: None)
    assert start_transports("shm", SimpleNamespace(kv_caches=kv), 30).kind == "grpc"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "--kv-transport nixl: this executor exposes no KV cache to register; KV transfers use gRPC",
        "--kv-transport nixl: NIXL cannot start here: NIXL is not importable (pip install --no-deps "
        "nixl-cu12): no module; KV transfers use gRPC",
        "--kv-transport shm: no /dev/shm or no boot id on this host; KV transfers use gRPC",
    ]
    monkeypatch.undo()
    shm = start_transports("shm", SimpleNamespace(kv_caches=kv), 30)
    assert shm.kind == "shm" and shm.offered.shm_host == shm_host_id()


async def test_each_shm_pull_uses_a_fresh_segment_made_ahead_and_close_leaves_none():
    before = shm_segments()
    p = Pair("shm")
    await p.source.server.start()
    try:
        seen: list[set[str]] = []
        for n in range(3):
            transfer = p.source.produce(list(range(300 + 20 * n, 312 + 20 * n)))  # 3 blocks
            assert (await p.transport.pull(p.spec(transfer), p.writer([1, 2, 3], 0))).num_blocks == 3
            assert_blocks_equal(p.source.kv, transfer.block_ids, p.dst_kv, [1, 2, 3])
            await until(lambda: len(shm_segments() - before) == 1, "the next pull's segment")
            seen.append(shm_segments() - before)
        # One segment waits for the next pull at a time, and each pull took the one made before it.
        assert len(set().union(*seen)) == 3
        assert p.source.bm.stats().used == 0
    finally:
        await p.close()
    assert shm_segments() - before == set()


async def test_a_nixl_read_that_fails_is_pulled_again_over_grpc(monkeypatch):
    """Fault injection: the source describes addresses outside its registered cache, so UCX cannot
    read them; the puller pulls the same (still pinned) transfer over gRPC."""
    p = Pair("nixl")
    await p.source.server.start()
    puller = KvPuller(
        LocalKvBlocks(TorchOps(), p.dst_kv),
        30,
        None,
        PLAINTEXT,
        KvTransports("nixl", SourceTransports(nixl=True), p.dst_nixl),
    )
    describe = p.source.nixl.describe

    def off_the_registered_memory(block_ids, known_agents):
        blocks = describe(block_ids, known_agents)
        regions = blocks.ranks[0].region_addresses
        regions[:] = [address + (1 << 40) for address in regions]
        return blocks

    monkeypatch.setattr(p.source.nixl, "describe", off_the_registered_memory)
    try:
        transfer = p.source.produce(list(range(50, 62)))  # 3 blocks
        spec = dataclasses.replace(p.spec(transfer), transports=SourceTransports(nixl=True))
        assert puller.choose(spec) == "nixl"
        result = await puller.pull(spec, [4, 5, 6])
        assert result is not None and result.num_blocks == 3
        assert puller.pulls_by_transport == {"grpc": 1}
        assert_blocks_equal(p.source.kv, transfer.block_ids, p.dst_kv, [4, 5, 6])
        assert p.source.bm.stats().used == 0 and p.source.registry.num_pending == 0
    finally:
        await puller.close()
        await p.close()


def test_block_runs_coalesce_blocks_consecutive_on_both_sides():
    runs = block_runs([4, 5, 6, 9, 10, 11, 2], [0, 1, 2, 3, 7, 8, 9])
    assert runs == [(4, 0, 3), (9, 3, 1), (10, 7, 2), (2, 9, 1)]
    assert block_runs([], []) == []


def test_split_moves_cuts_the_bytes_into_equal_shares_in_order():
    mib = 1 << 20
    moves = [(0, 100, 3 * mib), (10 * mib, 200, mib)]
    shares = split_moves(moves, 2)
    assert shares == [[(0, 100, 2 * mib)], [(2 * mib, 100 + 2 * mib, mib), (10 * mib, 200, mib)]]
    assert split_moves(moves, 1) == [moves]
    assert split_moves([(0, 0, mib // 2)], 4) == [[(0, 0, mib // 2)]]  # under 1 MiB: one thread
    assert split_moves([], 4) == []


def test_a_copy_split_across_threads_moves_every_block_exactly():
    """Copying with three threads lands the same bytes as one copy would, runs cut mid-block included."""
    blocks_per_region, block_bytes, regions = 96, 64 * 1024, 4
    cache = SharedKvCacheFile(regions, blocks_per_region * block_bytes)
    views = [
        np.frombuffer(buffer, dtype=np.uint8).reshape(blocks_per_region, block_bytes)
        for buffer in cache.buffers
    ]
    rng = np.random.default_rng(0)
    for view in views:
        view[:] = rng.integers(0, 255, view.shape, dtype=np.uint8)
    source_ids, dest_ids = [*range(10, 60), 3, 90], [*range(40, 90), 0, 7]
    described = cache.describe(source_ids, block_bytes)
    mapped = MappedKvSource(described)
    dest = [torch.zeros(blocks_per_region, block_bytes, dtype=torch.uint8) for _ in range(regions)]
    try:
        copied = copy_blocks(mapped, described, dest, dest_ids, threads=3)
        assert copied == regions * len(source_ids) * block_bytes
        untouched = sorted(set(range(blocks_per_region)) - set(dest_ids))
        for view, tensor in zip(views, dest, strict=True):
            assert np.array_equal(tensor.numpy()[dest_ids], view[source_ids])
            assert not tensor.numpy()[untouched].any()
    finally:
        mapped.close()
        del views, view
        for buffer in cache.buffers:
            buffer.close()
        os.close(cache.fd)


async def test_a_source_whose_cache_is_not_shared_is_pulled_from_through_segments(caplog):
    """A direct pull from a source serving only segments (its cache in worker processes, or on a device)
    is UNIMPLEMENTED; the transport pulls the same pending transfer through a segment, and from then on
    goes to that source through segments at once."""
    caplog.set_level("INFO", logger="conduit_engine.kv_transfer.shm_transport")
    before = shm_segments()
    p = Pair("shm")
    p.transport = ShmKvTransport(caches=flat(p.dst_kv), timeout_s=30)
    await p.source.server.start()
    try:
        for n in range(2):
            transfer = p.source.produce(list(range(40 + 20 * n, 52 + 20 * n)))  # 3 blocks
            assert (await p.transport.pull(p.spec(transfer), p.writer([4, 5, 6], 0))).num_blocks == 3
            assert_blocks_equal(p.source.kv, transfer.block_ids, p.dst_kv, [4, 5, 6])
            assert p.source.bm.stats().used == 0 and p.source.registry.num_pending == 0
        notes = [r.getMessage() for r in caplog.records if "go through segments" in r.getMessage()]
        assert len(notes) == 1 and "UNIMPLEMENTED: shm_direct: this engine's KV cache is not in" in notes[0]
    finally:
        await p.close()
    assert shm_segments() - before == set()


async def test_a_file_that_is_not_the_sources_cache_is_never_read(monkeypatch):
    """Fault injection: the source names a descriptor whose inode is not its cache's (a reused pid or
    descriptor looks like this). The puller refuses to map it and pulls the still pending transfer
    through a segment."""
    p = Pair("shm-direct")
    await p.source.server.start()
    describe = p.source.shm_cache.describe

    def wrong_inode(*args):
        blocks = describe(*args)
        blocks.inode += 1
        return blocks

    monkeypatch.setattr(p.source.shm_cache, "describe", wrong_inode)
    try:
        transfer = p.source.produce(list(range(12)))
        assert (await p.transport.pull(p.spec(transfer), p.writer([0, 1, 2], 0))).num_blocks == 3
        assert_blocks_equal(p.source.kv, transfer.block_ids, p.dst_kv, [0, 1, 2])
        assert p.source.bm.stats().used == 0 and p.source.registry.num_pending == 0
    finally:
        await p.close()


async def test_a_direct_pull_of_blocks_outside_the_sources_cache_writes_nothing(monkeypatch):
    """Fault injection: a confused or hostile source describes blocks past the end of its cache."""
    p = Pair("shm-direct")
    await p.source.server.start()
    describe = p.source.shm_cache.describe
    monkeypatch.setattr(
        p.source.shm_cache, "describe", lambda ids, stride: describe([*ids[:-1], 10**6], stride)
    )
    try:
        transfer = p.source.produce(list(range(12)))
        writer = p.writer([0, 1, 2], 0)
        with pytest.raises(KvTransferError, match=r"source blocks \[1000000, 1000001\) lie past the end"):
            await p.transport.pull(p.spec(transfer), writer)
        assert writer.blocks_written == 0 and all(not k.any() and not v.any() for k, v in p.dst_kv)
        # The failed pull left the transfer pending (KvPuller's failure path then releases it).
        assert p.source.registry.release(transfer.transfer_id)
    finally:
        await p.close()
    p.source.bm.check_integrity([])


async def test_a_lease_ending_during_a_direct_copy_fails_the_pull(monkeypatch):
    p = Pair("shm-direct")
    await p.source.server.start()
    try:
        transfer = p.source.produce(list(range(12)))

        def copy_past_the_lease(*args):
            copied = copy_blocks(*args)
            p.source.clock.now += LEASE  # the source frees the blocks: what was copied may be stale
            assert p.source.registry.expire_due() == [transfer.transfer_id]  # (the loop awaits the copy)
            return copied

        monkeypatch.setattr("conduit_engine.kv_transfer.shm_transport.copy_blocks", copy_past_the_lease)
        with pytest.raises(KvTransferError, match="the transfer ended during the copy"):
            await p.transport.pull(p.spec(transfer), p.writer([0, 1, 2], 0))
        assert p.source.bm.stats().used == 0 and p.source.registry.num_pending == 0
    finally:
        await p.close()


def test_an_in_process_engine_with_shm_shares_its_cache_and_pulls_into_it():
    kv, shared = shared_copy(caches(torch.float32, seed=3))
    transports = start_transports("shm", SimpleNamespace(kv_caches=kv, kv_cache_file=shared), 30)
    assert transports.shm_cache is shared and transports.caches == flat(kv)
    assert "its KV cache shared" in transports.describe()
    workers = start_transports("shm", object(), 30)  # tensor parallelism: the cache is in the workers
    assert (workers.kind, workers.shm_cache, workers.caches) == ("shm", None, None)
    assert "through segments" in workers.describe()


def test_a_mapped_source_is_unmapped_when_it_restarts_or_idles_but_never_under_a_copy():
    _, first = shared_copy(caches(torch.float32, seed=1))
    _, second = shared_copy(caches(torch.float32, seed=2))  # the same address after a restart
    stride = first.region_bytes // NUM_BLOCKS
    mapped = MappedKvSources(idle_s=60)
    old = mapped.acquire("h:1", first.describe([0], stride))  # a copy in progress holds it
    new = mapped.acquire("h:1", second.describe([0], stride))
    assert new is not old and len(mapped) == 1
    assert old.address and not old._map.closed  # retired, still mapped under its copy
    mapped.release(old)
    assert old._map.closed
    mapped.release(new)
    assert not new._map.closed  # still the source's mapping, kept for its next pull
    assert mapped.sweep() == 0
    assert mapped.sweep(now=time.monotonic() + 60) == 1 and new._map.closed and len(mapped) == 0
    again = mapped.acquire("h:1", second.describe([0], stride))
    mapped.close()  # the engine stops during a copy: unmapped when the copy is done
    assert not again._map.closed
    mapped.release(again)
    assert again._map.closed
