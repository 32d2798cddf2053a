"""Prefix-cache events: the block manager records exactly the blocks that enter and leave its cache, the
engine loop numbers them in batches, and a snapshot plus the later batches replay the cache (no torch)."""

from __future__ import annotations

import asyncio

import pytest

from conduit_engine.core.block_manager import BlockManager, chain_hash, prefix_block_hashes
from conduit_engine.core.kv_events import AllCleared, BlockRemoved, BlockStored
from conduit_engine.core.sequence import Sequence
from conduit_engine.engine.kv_events import KvEventPublisher
from conduit_engine.errors import QueueFullError
from conduit_engine.sampling_params import SamplingParams
from tests.engine.support.harness import generate, greedy, make_engine

pytestmark = pytest.mark.unit

BS = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(max_tokens=8))


def admit(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate_prefix(seq)
    assert bm.ensure_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed_blocks(seq)


def test_full_blocks_are_stored_with_their_parent_and_tokens_and_evictions_removed():
    bm = BlockManager(num_blocks=3, block_size=BS)
    publisher = KvEventPublisher(bm)
    seq = make_seq(list(range(10)))  # two full blocks and a partial one
    admit(bm, seq)
    h0 = chain_hash(None, (0, 1, 2, 3))
    h1 = chain_hash(h0, (4, 5, 6, 7))
    batch = publisher.log.take_batch()
    assert batch is not None and batch.sequence == 1 and batch.num_cached == 2
    assert batch.events == (BlockStored(h0, None, (0, 1, 2, 3)), BlockStored(h1, h0, (4, 5, 6, 7)))
    assert publisher.log.take_batch() is None  # nothing new: no batch, no number used
    bm.free(seq)  # freed blocks keep their content: no event
    assert publisher.log.take_batch() is None
    # A new prompt needs all three blocks: the cached ones are reused for other content, tail first.
    other = make_seq([9] * 12)
    admit(bm, other)
    batch = publisher.log.take_batch()
    assert batch is not None and batch.sequence == 2
    assert batch.events[:2] == (BlockRemoved(h1), BlockRemoved(h0))
    assert [type(e) for e in batch.events[2:]] == [BlockStored] * 3
    assert [e.block_hash for e in batch.events[2:]] == prefix_block_hashes([9] * 12, BS)
    bm.check_integrity([other])


def test_the_same_content_in_a_second_block_is_stored_once():
    bm = BlockManager(num_blocks=4, block_size=BS)
    publisher = KvEventPublisher(bm)
    first, second = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 6])
    bm.allocate_prefix(first)
    bm.allocate_prefix(second)  # before the first computed: no hit, its own block
    for seq in (first, second):
        assert bm.ensure_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.commit_computed_blocks(seq)
    batch = publisher.log.take_batch()
    assert batch is not None and len(batch.events) == 1


def test_a_snapshot_then_the_batches_after_it_replay_the_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    publisher = KvEventPublisher(bm)

    async def run_on_engine(fn):
        return fn()

    async def scenario():
        admit(bm, make_seq(list(range(9))))  # pending, not yet published
        snapshot, batches = await publisher.subscribe(run_on_engine)
        assert snapshot.sequence == 1  # the pending events became batch 1, before the snapshot
        view = {block.block_hash for block in snapshot.blocks}
        assert view == set(prefix_block_hashes(list(range(9)), BS))
        admit(bm, make_seq([7] * 8))
        publisher.publish()
        publisher.clear()
        publisher.close()
        got = [batch async for batch in batches]
        assert [batch.sequence for batch in got] == [2, 3]
        for batch in got:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    view.add(event.block_hash)
                elif isinstance(event, BlockRemoved):
                    view.discard(event.block_hash)
                elif isinstance(event, AllCleared):
                    view.clear()
        assert view == set() and publisher.num_subscribers == 0

    asyncio.run(scenario())


def test_a_subscriber_that_falls_behind_is_dropped_not_waited_for():
    bm = BlockManager(num_blocks=64, block_size=BS)
    publisher = KvEventPublisher(bm, max_pending=2)

    async def run_on_engine(fn):
        return fn()

    async def scenario():
        _, batches = await publisher.subscribe(run_on_engine)
        for start in range(0, 12, 4):
            admit(bm, make_seq([start + 100] * 4 + [1]))
            publisher.publish()  # the step loop never waits for the subscriber
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            [batch async for batch in batches]
        assert publisher.num_subscribers == 0

    asyncio.run(scenario())


def test_a_queued_prompt_moves_its_cached_prefix_to_the_back_of_the_eviction_order():
    bm = BlockManager(num_blocks=6, block_size=BS)
    first, other = make_seq(list(range(9))), make_seq([50] * 9)
    admit(bm, first)
    bm.free(first)  # free order: its partial block, block 1, block 0
    admit(bm, other)
    bm.free(other)
    before = bm.free_block_ids()
    assert bm.touch_prefix(list(range(9)) + [99]) == 2
    # Its two full blocks are now the last to be reused, block 0 (the head) last of all.
    assert bm.free_block_ids() == [b for b in before if b not in first_blocks(bm)] + first_blocks(bm)[::-1]
    bm.check_integrity([])


def first_blocks(bm: BlockManager) -> list[int]:
    """The blocks holding the first prompt's full blocks, head first."""
    return [bm._cached[h] for h in prefix_block_hashes(list(range(9)), BS)]


def test_the_evictions_of_a_step_are_published_before_its_model_runs(stories_path):
    # 6 blocks of 16 tokens: the second prompt's blocks can only come from evicting the first one's.
    engine = make_engine(stories_path, num_blocks=6, block_size=16)
    log = engine.kv_events.log
    generate(engine, {"a": list(range(10, 70))}, greedy(4))  # 60 + 4 tokens: 3 full blocks cached
    engine.kv_events.publish()
    cached_before = log.num_cached
    assert cached_before == 3
    seen: list[tuple[bool, int]] = []
    execute = engine.executor.execute

    def watching(scheduled):
        seen.append((log.has_pending, log.num_cached))
        return execute(scheduled)

    engine.executor.execute = watching
    generate(engine, {"b": list(range(100, 180))}, greedy(1))  # 80 tokens: 5 blocks, evicts a's
    # At the first (prefill) step the model ran with the evictions already taken as a batch: a router
    # reading the events never sends a request here for blocks scheduling just reused.
    pending, cached = seen[0]
    assert not pending and cached < cached_before
    engine.shutdown()
