"""NIXL reads between KV caches split over tensor-parallel ranks, byte for byte, without engines: real
NIXL agents over real cache shards (each rank's KV heads, as ShardPlan splits them), through the real
endpoints: `NixlKvEndpoint` for one rank in the engine process, `WorkerNixlEndpoint` for workers, whose
commands run here through each rank's real `RankNixl` instead of the pipes (the frames are the real
ones, encoded and decoded). Every pair of sizes the model allows, replicated KV heads too; the second
pull of a source sends no metadata; a cancelled worker read waits for every rank's answer.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from conduit_engine.executor.nixl_workers import WorkerNixlEndpoint
from conduit_engine.kv_transfer.errors import KvTransportUnavailableError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.nixl_agent import NixlKvEndpoint
from conduit_engine.models.sharding import ShardPlan
from conduit_engine.worker.nixl_rank import RankNixl
from conduit_engine.worker.wire import Kind, decode
from tests.support.kv_blocks import nixl_endpoint_or_skip

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 2, 12, 4, 8
SOURCE = "127.0.0.1:1"

pytestmark = pytest.mark.unit


def full_cache(num_kv_heads: int, seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed or 0)
    shape = (BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)

    def make() -> torch.Tensor:
        return torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape)

    return [(make(), make()) for _ in range(LAYERS)]


class LocalRanks:
    """The workers of one engine, each rank's commands run in this process (RankCommands)."""

    def __init__(self, full: list[tuple[torch.Tensor, torch.Tensor]], size: int, num_kv_heads: int) -> None:
        self.plans = [ShardPlan(rank, size, 8, num_kv_heads, HEAD_DIM, 16, 32) for rank in range(size)]
        self.shards = []
        for plan in self.plans:
            start, stop = plan.kv_head_range_of(plan.rank)
            self.shards.append([(k[:, :, start:stop].clone(), v[:, :, start:stop].clone()) for k, v in full])
        self.nixl: list[RankNixl | None] = [None] * size
        self.gate = threading.Event()
        self.gate.set()

    def start_nixl(self, timeout_s: float) -> WorkerNixlEndpoint:  # as MultiprocExecutor's
        return WorkerNixlEndpoint(self, timeout_s)

    def ask_every_rank(self, frame: bytes, answer: Kind):
        command = decode(bytearray(frame))
        replies = []
        for rank, plan in enumerate(self.plans):
            if command.kind is Kind.NIXL_START:
                self.nixl[rank] = RankNixl.start(self.shards[rank], plan, rank, command.json())
                replies.append(self.nixl[rank].info())
            else:
                self.gate.wait(30)
                replies.append(RankNixl.read_answer(self.nixl[rank], command))
        frames = [decode(bytearray(reply)) for reply in replies]
        assert {f.kind for f in frames} == {answer}
        return frames

    def assembled(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole cache from the shards (a replicated head from its first rank)."""
        owners = self.plans[0].kv_owner_ranks()
        return [
            tuple(torch.cat([self.shards[r][layer][i] for r in owners], dim=2) for i in (0, 1))
            for layer in range(LAYERS)
        ]


def endpoint(size: int, full, num_kv_heads: int):
    """(endpoint, a function giving its whole cache) of an engine of `size` ranks over `full`."""
    if size == 1:
        nixl_endpoint_or_skip(full).close()  # skips where NIXL cannot start
        return NixlKvEndpoint(full, timeout_s=30), lambda: full
    ranks = LocalRanks(full, size, num_kv_heads)
    try:
        return WorkerNixlEndpoint(ranks, timeout_s=30), ranks.assembled
    except RuntimeError as exc:
        pytest.skip(f"NIXL cannot start here: {exc}")


@pytest.mark.parametrize(
    ("num_kv_heads", "src_size", "dst_size"),
    [(4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 1, 4), (4, 4, 2), (2, 4, 1), (2, 1, 4), (2, 4, 2)],
)
async def test_a_pull_between_tensor_parallel_sizes_moves_every_head_exactly(
    num_kv_heads, src_size, dst_size
):
    layout = KvLayoutSpec("m", "float32", BLOCK_SIZE, LAYERS, num_kv_heads, HEAD_DIM)
    source, source_cache = endpoint(src_size, full_cache(num_kv_heads, seed=1), num_kv_heads)
    dest, dest_cache = endpoint(dst_size, full_cache(num_kv_heads, seed=None), num_kv_heads)
    try:
        for src_ids, dst_ids in (([3, 4, 5, 9], [0, 1, 7, 8]), ([10, 2], [5, 11])):
            blocks = source.describe(src_ids, dest.known_agents(SOURCE))
            second = bool(dest.known_agents(SOURCE))
            assert all(bool(rank.agent_metadata) != second for rank in blocks.ranks)
            assert await dest.read(SOURCE, blocks, dst_ids, layout) == len(dst_ids) * layout.block_bytes
            for (sk, sv), (dk, dv) in zip(source_cache(), dest_cache(), strict=True):
                assert torch.equal(dk[dst_ids], sk[src_ids]) and torch.equal(dv[dst_ids], sv[src_ids])
        # Replicated heads are described once: one rank per distinct head range.
        assert sum(rank.kv_head_count for rank in blocks.ranks) == num_kv_heads
    finally:
        source.close()
        dest.close()


async def test_a_cancelled_worker_read_waits_for_every_rank_then_raises():
    layout = KvLayoutSpec("m", "float32", BLOCK_SIZE, LAYERS, 4, HEAD_DIM)
    source, source_cache = endpoint(1, full_cache(4, seed=2), 4)
    ranks = LocalRanks(full_cache(4, seed=None), 2, 4)
    try:
        dest = WorkerNixlEndpoint(ranks, timeout_s=30)
    except RuntimeError as exc:
        pytest.skip(f"NIXL cannot start here: {exc}")
    ranks.gate.clear()  # the ranks hold their answers: the read is in flight
    read = asyncio.ensure_future(dest.read(SOURCE, source.describe([1, 2], []), [6, 7], layout))
    await asyncio.sleep(0.2)
    read.cancel()
    await asyncio.sleep(0.2)
    assert not read.done()  # the destination blocks may still be written: it waits
    ranks.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert torch.equal(ranks.assembled()[0][0][[6, 7]], source_cache()[0][0][[1, 2]])
    source.close()


async def test_a_rank_whose_read_fails_makes_the_pull_fall_back_and_its_agents_reload():
    layout = KvLayoutSpec("m", "float32", BLOCK_SIZE, LAYERS, 4, HEAD_DIM)
    source, _ = endpoint(1, full_cache(4, seed=3), 4)
    dest, _ = endpoint(2, full_cache(4, seed=None), 4)
    try:
        blocks = source.describe([1, 2], [])
        regions = blocks.ranks[0].region_addresses
        regions[:] = [address + (1 << 40) for address in regions]  # outside the registered memory
        with pytest.raises(KvTransportUnavailableError, match="failed on a rank"):
            await dest.read(SOURCE, blocks, [3, 4], layout)
        assert dest.known_agents(SOURCE) == []  # the next pull sends the metadata again
        assert await dest.read(SOURCE, source.describe([1, 2], []), [3, 4], layout) > 0
    finally:
        source.close()
        dest.close()


def test_workers_that_cannot_start_nixl_make_the_engine_say_why_and_run_grpc(monkeypatch, caplog):
    from conduit_engine.kv_transfer import nixl_agent
    from conduit_engine.kv_transfer.setup import start_transports

    def missing():
        raise ImportError("NIXL is not importable (pip install --no-deps nixl-cu12): no module")

    monkeypatch.setattr(nixl_agent, "load_nixl", missing)
    caplog.set_level("WARNING", logger="conduit_engine.kv_transfer.setup")
    transports = start_transports("nixl", LocalRanks(full_cache(4, seed=None), 2, 4), 30)
    assert (transports.kind, transports.nixl) == ("grpc", None)
    assert [r.getMessage() for r in caplog.records if r.name.endswith(".setup")] == [
        "--kv-transport nixl: NIXL cannot start here: worker rank 0: ImportError: NIXL is not importable "
        "(pip install --no-deps nixl-cu12): no module; KV transfers use gRPC"
    ]
