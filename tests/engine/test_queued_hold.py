"""A waiting request holds its cached prefix (Scheduler + BlockManager.hold_prefix; no torch).

The hold is what keeps a cache-aware router's prediction true: blocks freed after a request queued go
behind its prefix in the eviction order, so without a hold the next allocations evict the prefix first.
Every test ends with the cache empty: no block used, none held.
"""

from __future__ import annotations

import pytest

from conduit_engine.config import SchedulerConfig
from tests.engine.support.sched_sim import SimEngine

pytestmark = pytest.mark.unit

PREFIX = [1, 2, 3, 4, 5, 6, 7, 8]  # four blocks of 2


def assert_empty(engine: SimEngine) -> None:
    stats = engine.block_manager.stats()
    assert (stats.used, stats.held, engine.block_manager.num_held_blocks) == (0, 0, 0)
    engine.block_manager.check_integrity([])


def warm(engine: SimEngine) -> None:
    engine.add("warm", PREFIX, 1)
    engine.run()
    assert engine.block_manager.stats().cached == 4


def evict_while_waiting(fraction: float) -> SimEngine:
    """`hit` queues behind `runner` with PREFIX cached; `runner`'s blocks, freed after `hit` queued, go
    behind PREFIX in the eviction order; then `urgent` (ahead of `hit` in the queue) takes 6 blocks."""
    engine = SimEngine(num_blocks=12, block_size=2, max_num_seqs=1, queued_hold_fraction=fraction)
    warm(engine)
    engine.add("runner", [50, 51, 52, 53, 54, 55, 56, 57], 1)
    engine.add("hit", [*PREFIX, 99], 1)
    assert engine.scheduler.num_waiting == 2
    engine.step()  # runner prefills and finishes
    assert engine.seqs["runner"].is_finished and not engine.seqs["hit"].was_admitted
    engine.add("urgent", list(range(60, 72)), 1, priority=-1)
    engine.run()
    return engine


def test_a_held_prefix_survives_allocations_that_would_evict_a_touched_one():
    held = evict_while_waiting(0.5)
    assert held.seqs["hit"].num_cached_tokens == 8  # all four blocks, as predicted when it queued
    assert_empty(held)
    touched = evict_while_waiting(0.0)
    assert touched.seqs["hit"].num_cached_tokens == 4  # urgent took two of them (tail first)
    assert_empty(touched)


def test_holds_stay_within_the_budget_and_later_requests_only_touch():
    engine = SimEngine(num_blocks=20, block_size=2, max_num_seqs=1, queued_hold_fraction=0.3)  # 6 blocks
    warm(engine)
    engine.add("runner", [50, 51, 52], 1)
    for name in ("a", "b", "c"):
        engine.add(name, [*PREFIX, 90], 1)
    bm = engine.block_manager
    assert engine.scheduler.hold_budget == 6
    held = [bm.held_blocks(engine.seqs[name]) for name in ("a", "b", "c")]
    assert [len(h) for h in held] == [4, 2, 0]  # the third waits with its prefix only touched
    assert held[1] == held[0][:2]  # from the head: the part admission can reuse
    assert bm.num_held_blocks == bm.stats().held == 6
    assert [bm.blocks[b].ref_count for b in held[0]] == [2, 2, 1, 1]
    engine.run()
    assert [engine.seqs[name].num_cached_tokens for name in ("a", "b", "c")] == [8, 8, 8]
    assert_empty(engine)


def test_aborting_a_waiting_request_releases_its_hold():
    engine = SimEngine(num_blocks=12, block_size=2, max_num_seqs=1, queued_hold_fraction=0.25)
    warm(engine)
    engine.add("runner", [50, 51, 52], 4)
    engine.add("waiting", [*PREFIX, 99], 1)
    bm = engine.block_manager
    assert bm.num_held_blocks == 3  # budget int(0.25 * 12)
    engine.abort("waiting")
    assert bm.num_held_blocks == 0 and bm.stats().cached == 4  # still cached, only no longer held
    engine.run()
    assert_empty(engine)


def test_a_running_sequence_takes_held_blocks_before_anything_is_preempted():
    # 8 blocks, 4 held by the waiting request: the runner grows to 6 blocks and needs 2 of them.
    engine = SimEngine(num_blocks=8, block_size=2, max_num_seqs=1, queued_hold_fraction=0.5)
    warm(engine)
    engine.add("runner", [50, 51], 10)
    engine.add("waiting", [*PREFIX, 99], 1)
    assert engine.block_manager.num_held_blocks == 4
    records = engine.run()
    assert not any(r.preempted for r in records)
    assert engine.seqs["waiting"].num_cached_tokens < 8  # the hold gave way, the runner kept running
    assert_empty(engine)


def test_the_head_of_the_queue_takes_blocks_held_by_requests_behind_it():
    # "big" needs 7 of the 8 blocks; "small" (behind it) holds 4: big is admitted, not stalled.
    engine = SimEngine(num_blocks=8, block_size=2, max_num_seqs=1, queued_hold_fraction=0.5)
    warm(engine)
    engine.add("runner", [50], 1)
    engine.add("big", list(range(30, 44)), 1)
    engine.add("small", [*PREFIX, 99], 1)
    assert engine.block_manager.held_blocks(engine.seqs["small"]) != []
    engine.run()
    assert all(engine.seqs[name].is_finished for name in ("big", "small"))
    assert_empty(engine)


def test_a_preempted_sequence_holds_nothing_while_it_waits_again():
    engine = SimEngine(num_blocks=6, block_size=2, max_num_seqs=2)
    engine.add("first", [1, 2, 3], 6)
    engine.add("second", [4, 5, 6], 6)
    records = engine.run()
    assert any(r.preempted for r in records)
    assert_empty(engine)


def test_the_fraction_is_validated():
    with pytest.raises(ValueError, match="--queued-hold-fraction must be in \\[0, 1\\], got 1.5"):
        SchedulerConfig(queued_hold_fraction=1.5)
