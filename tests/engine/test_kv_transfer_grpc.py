"""KV transfer end to end over a real grpc.aio server on 127.0.0.1: PullKv served from a registry and real
KV cache tensors, pulled by GrpcKvTransport into a second cache through CacheBlockWriter (both caches read
and written through LocalKvBlocks).

The bytes must round-trip exactly (torch.equal) for every dtype, with several chunks, from a start_block
past the puller's prefix-cache hits, and into non-contiguous destination blocks; every way a pull can
fail gives its status code and leaves the source's blocks accounted for.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.sequence import Sequence
from conduit_engine.kv_transfer.cache_io import CacheBlockWriter
from conduit_engine.kv_transfer.errors import (
    KvLayoutMismatchError,
    KvSourceUnavailableError,
    KvTransferError,
    KvTransferNotFoundError,
)
from conduit_engine.kv_transfer.grpc_transport import GrpcKvTransport
from conduit_engine.kv_transfer.proto import handle_to_pb
from conduit_engine.kv_transfer.pull_plan import commit_pull, plan_pull
from conduit_engine.kv_transfer.registry import KvTransferRegistry
from conduit_engine.kv_transfer.service import KvTransferService
from conduit_engine.kv_transfer.transport import KvPullSpec
from conduit_engine.ops.torch_ops import TorchOps
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.worker.kv_cache import allocate_kv_caches, shared_kv_cache_file
from tests.support.clock import ManualClock
from tests.support.kv_blocks import LocalKvBlocks, layout_of, nixl_endpoint_or_skip, pull_spec_for

# Makes KV segments in /dev/shm: one such module at a time (tests/conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kv_shm_exclusive")]

LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM = 3, 16, 4, 2, 8
LEASE = 30.0


def store(kv) -> LocalKvBlocks:
    return LocalKvBlocks(TorchOps(), kv)


def writer_for(kv, dest_block_ids, start_block: int) -> CacheBlockWriter:
    """A sink writing into caches `kv` (blocks of their own layout)."""
    return CacheBlockWriter(store(kv), layout_of("m", kv).block_bytes, dest_block_ids, start_block)


async def on_this_thread(fn):
    """run_on_engine for tests: the event loop thread is the only one touching the registry here."""
    return fn()


def caches(dtype: torch.dtype, seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random caches (a source's), or zeros when `seed` is None (a destination's)."""
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(LAYERS)
    ]


def shared_copy(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """`kv` copied into caches that live in a shared memfd, as an in-process engine's with
    --kv-transport shm; returns (caches, the SharedKvCacheFile)."""
    first = kv[0][0]
    shared = shared_kv_cache_file(len(kv), tuple(first.shape), first.dtype)
    out = allocate_kv_caches(len(kv), tuple(first.shape), first.dtype, torch.device("cpu"), shared)
    for (k, v), (k_out, v_out) in zip(kv, out, strict=True):
        k_out.copy_(k)
        v_out.copy_(v)
    return out, shared


class GatedKvBlocks(LocalKvBlocks):
    """Fault injection: every gather after the first waits for `gate` (so a pull broken after its first
    chunk cannot have been sent whole before the puller went away)."""

    def __init__(self, ops, kv_caches, gate: threading.Event) -> None:
        super().__init__(ops, kv_caches)
        self._gate = gate
        self._gathers = 0

    def _wait(self) -> None:
        self._gathers += 1
        if self._gathers > 1:
            assert self._gate.wait(30), "the gate was never opened"

    def gather_kv_blocks(self, block_ids):
        self._wait()
        return super().gather_kv_blocks(block_ids)

    def gather_kv_blocks_into(self, block_ids, out) -> None:
        self._wait()
        super().gather_kv_blocks_into(block_ids, out)


class Source:
    """A prefill engine's transfer side: BlockManager, registry, caches, and PullKv on a real server."""

    def __init__(
        self,
        dtype: torch.dtype,
        chunk_blocks: int = 2,
        security=None,
        transport: str = "grpc",
        gate: threading.Event | None = None,
    ) -> None:
        """`security`: a ServerSecurity for the port (TLS, token); None is plaintext. `transport`: what it
        serves besides gRPC (shm; shm-direct: shm with its caches in a shared memfd, as an in-process
        engine's; or nixl: an agent over its caches; skips where NIXL cannot start)."""
        self.clock = ManualClock()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK)
        self.registry = KvTransferRegistry(self.bm, LEASE, self.clock)
        self.kv = caches(dtype, seed=7)
        self.shm_cache = None
        if transport == "shm-direct":
            self.kv, self.shm_cache = shared_copy(self.kv)
        self.layout = layout_of("stories-test", self.kv)
        self.nixl = nixl_endpoint_or_skip(self.kv) if transport == "nixl" else None
        store = (
            LocalKvBlocks(TorchOps(), self.kv) if gate is None else GatedKvBlocks(TorchOps(), self.kv, gate)
        )
        self.service = KvTransferService(
            self.registry,
            store,
            self.layout,
            on_this_thread,
            chunk_bytes=chunk_blocks * self.layout.block_bytes,
            shm_chunk_bytes=chunk_blocks * self.layout.block_bytes,
            serve_shm=transport in ("shm", "shm-direct"),
            nixl=self.nixl,
            shm_cache=self.shm_cache,
        )
        self.server = grpc.aio.server(interceptors=security.interceptors() if security else [])
        pb_grpc.add_EngineServicer_to_server(self.servicer(), self.server)
        if security is not None:
            self.port = security.add_port(self.server, "127.0.0.1:0")
        else:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def servicer(self) -> pb_grpc.EngineServicer:
        service = self.service

        class Servicer(pb_grpc.EngineServicer):
            async def PullKv(self, request, context):
                # grpc.aio recognises a streaming handler by being an async generator function.
                async for chunk in service.pull_kv(request, context):
                    yield chunk

            async def ReleaseKv(self, request, context):
                return await service.release_kv(request, context)

        return Servicer()

    def produce(self, prompt: list[int]):
        """A prefill ending at its first token: pin the prompt's blocks, free the sequence."""
        seq = Sequence("p", list(prompt), SamplingParams(max_tokens=4))
        self.bm.allocate_prefix(seq)
        assert self.bm.ensure_slots(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        self.bm.commit_computed_blocks(seq)
        transfer = self.registry.produce(seq.block_table[: self.bm.blocks_needed(len(prompt))], prompt)
        self.bm.free(seq)
        return transfer

    def handle(self, transfer) -> pb.KvHandle:
        return handle_to_pb(transfer, self.address, self.layout)


@pytest.fixture
async def source():
    src = Source(torch.float32)
    await src.server.start()
    yield src
    await src.server.stop(None)
    src.registry.check_integrity()
    src.bm.check_integrity([])


@pytest.fixture
async def transport():
    t = GrpcKvTransport(timeout_s=30)
    yield t
    await t.close()


def assert_blocks_equal(src_kv, src_ids, dst_kv, dst_ids) -> None:
    for (sk, sv), (dk, dv) in zip(src_kv, dst_kv, strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(sk[s], dk[d]) and torch.equal(sv[s], dv[d])


def consume_plan(bm: BlockManager, prompt: list[int]):
    seq = Sequence("d", list(prompt), SamplingParams(max_tokens=4))
    seq.append_token(1)
    plan = plan_pull(bm, seq, len(prompt))
    assert plan is not None
    return plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
async def test_a_pull_round_trips_the_bytes_exactly_over_several_chunks(dtype, transport):
    src = Source(dtype, chunk_blocks=2)
    await src.server.start()
    try:
        prompt = list(range(100, 119))  # 19 tokens: 5 blocks, the last partly filled
        transfer = src.produce(prompt)
        dst_bm, dst_kv = BlockManager(NUM_BLOCKS, BLOCK), caches(dtype, seed=None)
        dst_bm.ensure_slots(Sequence("x", [0] * 9, SamplingParams()), 9)  # take 3 blocks: dest ids start at 3
        plan = consume_plan(dst_bm, prompt)
        assert (plan.start_block, plan.dest_block_ids) == (0, [3, 4, 5, 6, 7])
        spec = pull_spec_for(src.handle(transfer), src.layout, plan.start_block)
        writer = writer_for(dst_kv, plan.dest_block_ids, plan.start_block)
        result = await transport.pull(spec, writer)
        assert (result.num_blocks, result.num_bytes) == (5, 5 * src.layout.block_bytes)
        assert writer.blocks_written == 5
        assert_blocks_equal(src.kv, transfer.block_ids, dst_kv, plan.dest_block_ids)
        untouched = [b for b in range(NUM_BLOCKS) if b not in plan.dest_block_ids]
        assert all(not k[untouched].any() and not v[untouched].any() for k, v in dst_kv)
        commit_pull(dst_bm, plan)
        assert plan.seq.num_computed_tokens == 19
        # The pull completed: the source's blocks are free (still prefix-cached), the id is gone.
        assert src.bm.stats().used == 0 and src.registry.num_pending == 0 and src.bm.stats().cached == 4
        with pytest.raises(KvTransferNotFoundError, match="NOT_FOUND"):
            await transport.pull(spec, writer)
    finally:
        await src.server.stop(None)


async def test_a_pull_from_start_block_skips_the_prefix_cache_hits(source, transport):
    prompt = list(range(40, 54))  # 14 tokens: blocks 0..3
    transfer = source.produce(prompt)
    dst_bm, dst_kv = BlockManager(NUM_BLOCKS, BLOCK), caches(torch.float32, seed=None)
    warm = consume_plan(dst_bm, prompt[:9])  # the decode engine already holds the first two blocks
    commit_pull(dst_bm, warm)
    plan = consume_plan(dst_bm, prompt)
    assert plan.start_block == 2 and len(plan.dest_block_ids) == 2
    spec = pull_spec_for(source.handle(transfer), source.layout, plan.start_block)
    writer = writer_for(dst_kv, plan.dest_block_ids, plan.start_block)
    result = await transport.pull(spec, writer)
    assert result == type(result)(num_blocks=2, num_bytes=2 * source.layout.block_bytes)
    assert_blocks_equal(source.kv, transfer.block_ids[2:], dst_kv, plan.dest_block_ids)
    assert all(not k[warm.dest_block_ids].any() for k, _ in dst_kv)  # hits were not written
    assert source.bm.stats().used == 0


async def test_nothing_to_pull_still_completes_the_transfer(source, transport):
    transfer = source.produce(list(range(8)))
    spec = pull_spec_for(source.handle(transfer), source.layout, start_block=2)
    writer = writer_for(caches(torch.float32, seed=None), [], start_block=2)
    assert (await transport.pull(spec, writer)).num_blocks == 0
    assert writer.blocks_written == 0 and source.registry.num_pending == 0 and source.bm.stats().used == 0


async def test_unknown_released_and_expired_ids_are_not_found(source, transport):
    stub = pb_grpc.EngineStub(grpc.aio.insecure_channel(source.address))
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        async for _ in stub.PullKv(
            pb.PullKvRequest(transfer_id="nope", layout_fingerprint=source.layout.fingerprint)
        ):
            pass
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND
    assert "transfer_id: 'nope' is unknown here" in raw.value.details()
    writer = writer_for(caches(torch.float32, seed=None), [0], 0)
    released = source.produce([1, 2, 3])
    response = await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id=released.transfer_id))
    assert response.released and not (await stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id="nope"))).released
    expired = source.produce([4, 5, 6])
    source.clock.now += LEASE
    for transfer in (released, expired):
        with pytest.raises(KvTransferNotFoundError, match="NOT_FOUND"):
            await transport.pull(pull_spec_for(source.handle(transfer), source.layout, 0), writer)
    assert writer.blocks_written == 0 and source.bm.stats().used == 0
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.ReleaseKv(pb.ReleaseKvRequest())
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raw.value.details() == "transfer_id: must not be empty"


async def test_bad_requests_name_their_field_and_leave_the_transfer_pending(source, transport):
    transfer = source.produce(list(range(6)))  # 2 blocks
    stub = pb_grpc.EngineStub(grpc.aio.insecure_channel(source.address))
    cases = [
        (pb.PullKvRequest(transfer_id=transfer.transfer_id, layout_fingerprint="ab"), "FAILED_PRECONDITION"),
        (pb.PullKvRequest(transfer_id=transfer.transfer_id), "INVALID_ARGUMENT"),
        (pb.PullKvRequest(layout_fingerprint=source.layout.fingerprint), "INVALID_ARGUMENT"),
        (
            pb.PullKvRequest(
                transfer_id=transfer.transfer_id, start_block=3, layout_fingerprint=source.layout.fingerprint
            ),
            "INVALID_ARGUMENT",
        ),
    ]
    details = []
    for request, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in stub.PullKv(request):
                pass
        assert raw.value.code().name == code
        details.append(raw.value.details())
    assert details[0].startswith("layout_fingerprint: ab differs from this engine's")
    assert details[1:] == [
        "layout_fingerprint: must not be empty",
        "transfer_id: must not be empty",
        "start_block: must be at most 2 (the transfer's blocks), got 3",
    ]
    other = layout_of("another-model", source.kv)
    spec = KvPullSpec(source.address, transfer.transfer_id, 0, 2, other)
    with pytest.raises(KvLayoutMismatchError, match="FAILED_PRECONDITION"):
        await transport.pull(spec, writer_for(caches(torch.float32, seed=None), [0, 1], 0))
    assert source.registry.num_pending == 1 and source.bm.stats().pinned == 2
    assert source.registry.release(transfer.transfer_id)


async def test_a_source_that_is_down_is_unavailable(transport):
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await server.stop(None)  # the port is free again: nothing listens there
    layout = layout_of("m", caches(torch.float32, seed=None))
    spec = KvPullSpec(f"127.0.0.1:{port}", "id", 0, 1, layout)
    writer = writer_for(caches(torch.float32, seed=None), [0], 0)
    with pytest.raises(KvSourceUnavailableError, match="UNAVAILABLE"):
        await transport.pull(spec, writer)


class FailingWriter(CacheBlockWriter):
    """Fault injection: the destination fails after its first chunk (e.g. the decode engine aborts)."""

    async def write(self, first_block: int, num_blocks: int, data: bytes) -> None:
        await super().write(first_block, num_blocks, data)
        raise RuntimeError("destination failed")


async def test_a_pull_broken_midway_leaves_the_transfer_pullable_then_it_completes(transport):
    gate = threading.Event()
    source = Source(torch.float32, gate=gate)  # the source's second chunk waits for the gate
    await source.server.start()
    try:
        await broken_midway_then_complete(source, transport, gate)
    finally:
        gate.set()
        await source.server.stop(None)
    source.registry.check_integrity()
    source.bm.check_integrity([])


async def broken_midway_then_complete(source, transport, gate: threading.Event) -> None:
    prompt = list(range(200, 220))  # 5 blocks, chunks of 2
    transfer = source.produce(prompt)
    dst_kv = caches(torch.float32, seed=None)
    spec = pull_spec_for(source.handle(transfer), source.layout, 0)
    with pytest.raises(RuntimeError, match="destination failed"):
        await transport.pull(spec, FailingWriter(store(dst_kv), source.layout.block_bytes, range(5), 0))
    for _ in range(3000):  # the server sees the cancellation on its own loop turn
        if source.registry.transfer(transfer.transfer_id).active_pulls == 0:
            break
        await asyncio.sleep(0.01)
    gate.set()  # the second gather (its await was cancelled) may end now
    assert source.registry.num_pending == 1 and source.bm.stats().pinned == 5
    source.registry.check_integrity()
    writer = writer_for(dst_kv, range(5), 0)
    assert (await transport.pull(spec, writer)).num_blocks == 5
    assert_blocks_equal(source.kv, transfer.block_ids, dst_kv, range(5))
    assert source.bm.stats().used == 0


class MalformedSource(pb_grpc.EngineServicer):
    """Fault injection: a source whose second chunk's payload is one byte short."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes

    async def PullKv(self, request, context):
        yield pb.KvChunk(first_block=0, num_blocks=1, total_blocks=2, data=bytes(self.block_bytes))
        yield pb.KvChunk(first_block=1, num_blocks=1, total_blocks=2, data=bytes(self.block_bytes - 1))


async def test_a_malformed_chunk_is_refused_before_the_sink_sees_it(transport):
    dst_kv = caches(torch.float32, seed=None)
    layout = layout_of("m", dst_kv)
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(MalformedSource(layout.block_bytes), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        writer = writer_for(dst_kv, [4, 5], 0)
        spec = KvPullSpec(f"127.0.0.1:{port}", "id", 0, 2, layout)
        with pytest.raises(KvTransferError, match="1 blocks in 1535 bytes, expected 1536 each"):
            await transport.pull(spec, writer)
        assert writer.blocks_written == 1
        spec = KvPullSpec(f"127.0.0.1:{port}", "id", 0, 3, layout)
        with pytest.raises(KvTransferError, match="the source has 2 blocks, the handle 3"):
            await transport.pull(spec, writer)
    finally:
        await server.stop(None)


async def test_chunks_stay_whole_blocks_and_under_the_message_limit():
    src = Source(torch.float32, chunk_blocks=1)
    block = src.layout.block_bytes
    assert src.service.blocks_per_chunk == 1
    big = KvTransferService(src.registry, src.service._store, src.layout, on_this_thread, chunk_bytes=10**9)
    assert big.blocks_per_chunk == (64 * 1024 * 1024 - 64) // block
    with pytest.raises(ValueError, match="does not fit a 1000-byte gRPC message"):
        KvTransferService(
            src.registry, src.service._store, src.layout, on_this_thread, max_message_bytes=1000
        )


async def test_a_handle_names_the_field_that_is_wrong():
    src = Source(torch.float32)
    transfer = src.produce([1, 2, 3, 4, 5])
    handle = src.handle(transfer)
    assert handle.num_tokens == 5 and handle.expires_unix_ms == int((1_000.0 + LEASE) * 1000)
    assert handle.layout.fingerprint == src.layout.fingerprint and handle.source_address == src.address
    assert pull_spec_for(handle, src.layout, 1).total_blocks == 2
    for field, change in [("transfer_id", ""), ("source_address", "")]:
        bad = pb.KvHandle()
        bad.CopyFrom(handle)
        setattr(bad, field, change)
        with pytest.raises(ValueError, match=f"kv_transfer.consume.handle.{field}: must not be empty"):
            pull_spec_for(bad, src.layout, 0)
    with pytest.raises(KvLayoutMismatchError, match="handle.layout.fingerprint: .* cannot exchange KV"):
        pull_spec_for(handle, layout_of("other", src.kv), 0)
    with pytest.raises(ValueError, match=r"start_block: must lie in \[0, 2\]"):
        pull_spec_for(handle, src.layout, 3)
    src.registry.release(transfer.transfer_id)
