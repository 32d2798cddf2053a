"""BlockManager: exact block ids and free-queue order, ref counts, LRU eviction, invariants (no torch).

Every test ends with `check_integrity` against the sequences it still holds (the `bm` fixture does
it on teardown). The property tests drive random allocate/append/compute/free/preempt sequences
and keep a model of the KV slots, so a block shared or reused with the wrong content fails there.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from conduit_engine.core.block_manager import BlockManager, chain_hash, prefix_block_hashes
from conduit_engine.core.sequence import RELEASED_BLOCK, Sequence
from conduit_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def make_seq(tokens: list[int], **params: object) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(max_tokens=8, **params))  # type: ignore[arg-type]


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What a step does for `seq`: slots for the tokens, the model computes them, full blocks publish."""
    target = seq.num_tokens if num_tokens is None else seq.num_computed_tokens + num_tokens
    assert bm.ensure_slots(seq, target)
    seq.num_computed_tokens = target
    bm.commit_computed_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """First admission of `seq` with its whole prompt computed; returns the tokens reused."""
    reused = bm.allocate_prefix(seq)
    compute(bm, seq)
    return reused


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


class Tracker:
    """Holds the live sequences of a test so the fixture can check integrity against them."""

    def __init__(self) -> None:
        self.live: list[Sequence] = []
        self.managers: list[BlockManager] = []

    def __call__(self, seq: Sequence) -> Sequence:
        self.live.append(seq)
        return seq


@pytest.fixture
def live():
    return Tracker()


def manager(live: Tracker, num_blocks: int, block_size: int, **kw: object) -> BlockManager:
    bm = BlockManager(num_blocks, block_size, **kw)  # type: ignore[arg-type]
    live.managers.append(bm)
    return bm


@pytest.fixture(autouse=True)
def _integrity_after_each_test(live):
    yield
    for bm in live.managers:
        held = [s for s in live.live if s.block_table]
        bm.check_integrity(held)
        stats = bm.stats()
        assert stats.used + stats.free == stats.total


def test_fresh_blocks_come_in_id_order(live):
    bm = manager(live, 8, 4)
    seq = live(make_seq(list(range(10))))
    assert admit(bm, seq) == 0
    assert seq.block_table == [0, 1, 2]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    stats = bm.stats()
    assert (stats.used, stats.free, stats.cached) == (3, 5, 0)


def test_free_puts_the_tail_block_first_in_the_queue(live):
    bm = manager(live, 8, 4)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    bm.free(seq)
    # Freed last-block-first: the tail of a prefix is evicted before its head.
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    # Blocks 0 and 1 are full and keep their content; block 2 held only two tokens.
    assert bm.stats().cached == 2
    assert [b.hash is not None for b in bm.blocks[:3]] == [True, True, False]


def test_shared_prefix_shares_blocks_and_counts_references(live):
    bm = manager(live, 8, 4)
    a = live(make_seq(list(range(10))))
    admit(bm, a)
    b = live(make_seq(list(range(8)) + [50, 51, 52]))
    assert admit(bm, b) == 8
    assert b.block_table == [0, 1, 3]
    assert ref_counts(bm) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert bm.free_block_ids() == [4, 5, 6, 7]
    bm.free(a)
    live.live.remove(a)
    assert ref_counts(bm) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert bm.free_block_ids() == [4, 5, 6, 7, 2]
    bm.free(b)
    live.live.remove(b)
    assert bm.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert bm.stats().cached == 2


def test_three_sequences_share_one_prefix(live):
    bm = manager(live, 10, 2)
    first = live(make_seq([7, 7, 8, 8, 9]))
    admit(bm, first)
    others = [live(make_seq([7, 7, 8, 8, 100 + i, 1])) for i in range(2)]
    assert [admit(bm, s) for s in others] == [4, 4]
    assert [s.block_table for s in others] == [[0, 1, 3], [0, 1, 4]]
    assert ref_counts(bm)[:5] == [3, 3, 1, 1, 1]


def test_a_hit_leaves_the_last_prompt_token_to_compute(live):
    bm = manager(live, 8, 4)
    a = make_seq(list(range(8)))
    admit(bm, a)
    bm.free(a)
    assert bm.stats().cached == 2
    again = live(make_seq(list(range(8))))
    # Both blocks are cached, but the model must compute at least one token to sample from.
    assert bm.allocate_prefix(again) == 4
    assert again.block_table == [0] and again.num_computed_tokens == 4
    compute(bm, again)
    # The recomputed tail goes into the queue's head block; block 1 stays free and cached.
    assert again.block_table == [0, 2]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 1]
    assert bm.stats().cached == 1


def test_taking_a_cached_block_back_removes_it_from_the_middle_of_the_queue(live):
    bm = manager(live, 6, 2)
    a = make_seq([1, 2, 3, 4, 5, 6, 9])
    admit(bm, a)
    bm.free(a)
    assert bm.free_block_ids() == [4, 5, 3, 2, 1, 0]
    b = live(make_seq([1, 2, 3, 4, 40]))
    assert bm.allocate_prefix(b) == 4
    assert bm.free_block_ids() == [4, 5, 3, 2]
    compute(bm, b)
    assert b.block_table == [0, 1, 4]


def test_lru_eviction_takes_the_least_recently_freed_block_first(live):
    bm = manager(live, 6, 2)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])  # blocks 0, 1, 2 full and cached, block 3 partial
    admit(bm, a)
    b = make_seq([20, 21, 22, 23])  # blocks 4, 5
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.free_block_ids() == [3, 2, 1, 0, 5, 4]
    assert bm.stats().cached == 5
    # New content needs three blocks: a's partial block, then a's tail, then the middle of a.
    c = live(make_seq([90, 91, 92, 93, 94]))
    admit(bm, c)
    assert c.block_table == [3, 2, 1]
    assert bm.free_block_ids() == [0, 5, 4]
    assert bm.stats().cached == 3
    # a's prefix now only hits its first block; b's blocks are untouched.
    again_a = live(make_seq([1, 2, 3, 4, 5, 6, 7]))
    assert bm.allocate_prefix(again_a) == 2
    again_b = live(make_seq([20, 21, 22, 23, 24]))
    assert bm.allocate_prefix(again_b) == 4
    assert again_b.block_table == [4, 5]


def test_the_chain_hash_makes_a_block_depend_on_everything_before_it(live):
    bm = manager(live, 8, 2)
    a = make_seq([1, 2, 3, 4, 9])
    admit(bm, a)
    bm.free(a)
    # Same second block, different first block: no hit at all.
    b = live(make_seq([1, 5, 3, 4, 9]))
    assert bm.allocate_prefix(b) == 0
    assert chain_hash(None, (1, 2)) != chain_hash(None, (1, 5))
    assert chain_hash(chain_hash(None, (1, 2)), (3, 4)) != chain_hash(chain_hash(None, (1, 5)), (3, 4))


def test_two_sequences_computing_the_same_prefix_publish_it_once(live):
    bm = manager(live, 8, 2)
    # Both admitted before either computed: no hit, each computes its own copy.
    a, b = live(make_seq([1, 2, 3, 4, 5])), live(make_seq([1, 2, 3, 4, 6]))
    assert bm.allocate_prefix(a) == 0 and bm.allocate_prefix(b) == 0
    compute(bm, a)
    compute(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    assert [blk.hash is not None for blk in bm.blocks[:6]] == [True, True, False, False, False, False]
    for seq in (a, b):
        bm.free(seq)
    live.live.clear()
    assert bm.stats().cached == 2
    c = live(make_seq([1, 2, 3, 4, 7]))
    assert bm.allocate_prefix(c) == 4
    assert c.block_table == [0, 1]


def test_decoded_tokens_fill_and_publish_blocks(live):
    bm = manager(live, 8, 2)
    seq = live(make_seq([1, 2, 3]))
    admit(bm, seq)
    assert seq.block_table == [0, 1] and bm.blocks[1].hash is None
    seq.append_token(4)  # sampled; its KV is computed by the next step
    assert bm.blocks[1].hash is None
    compute(bm, seq)
    assert seq.block_table == [0, 1] and bm.blocks[1].hash == chain_hash(bm.blocks[0].hash, (3, 4))
    seq.append_token(5)
    compute(bm, seq)
    assert seq.block_table == [0, 1, 2]
    # A later request with the prompt + generated text reuses the generated block too.
    other = live(make_seq([1, 2, 3, 4, 5]))
    assert bm.allocate_prefix(other) == 4


def test_ensure_slots_is_all_or_nothing(live):
    bm = manager(live, 4, 2)
    a = live(make_seq([1, 2, 3, 4, 5]))
    admit(bm, a)
    b = live(make_seq([9, 9, 9, 9]))
    assert not bm.ensure_slots(b, 4)  # needs 2 blocks, 1 free
    assert b.block_table == [] and bm.free_block_ids() == [3]
    assert bm.ensure_slots(b, 2)
    assert b.block_table == [3]


def test_preemption_frees_and_the_recompute_reuses_the_cached_prefix(live):
    bm = manager(live, 8, 2)
    seq = live(make_seq([1, 2, 3, 4, 5]))
    admit(bm, seq)
    for token in (6, 7):
        seq.append_token(token)
        compute(bm, seq)
    assert seq.block_table == [0, 1, 2, 3] and seq.num_computed_tokens == 7
    bm.free(seq)  # preempted
    assert seq.num_computed_tokens == 0
    # Recompute of prompt + output: three full blocks come back, the last token is recomputed.
    assert bm.allocate_prefix(seq) == 6
    assert seq.block_table == [0, 1, 2]
    compute(bm, seq)
    assert seq.block_table == [0, 1, 2, 4]


def test_prefix_caching_off_never_hashes_or_reuses(live):
    bm = manager(live, 8, 2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    assert all(b.hash is None for b in bm.blocks)
    bm.free(a)
    b = live(make_seq([1, 2, 3, 4, 5]))
    assert bm.allocate_prefix(b) == 0
    compute(bm, b)
    assert b.block_table == [3, 4, 5]
    assert bm.stats().cached == 0


def test_a_request_owing_prompt_logprobs_takes_no_cached_blocks(live):
    # Bug fixed: a cache hit skipped the model at the cached positions, so their prompt logprobs
    # were never computed (the second request got 0 of 20).
    bm = manager(live, 8, 2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    wants_logprobs = live(make_seq([1, 2, 3, 4, 5], prompt_logprobs=1))
    assert bm.allocate_prefix(wants_logprobs) == 0
    compute(bm, wants_logprobs)
    # Once its first token is out it owes nothing: a recompute after preemption may reuse blocks.
    wants_logprobs.append_token(6)
    compute(bm, wants_logprobs)
    bm.free(wants_logprobs)
    assert bm.allocate_prefix(wants_logprobs) == 4


# Two different 16-token blocks on which CPython's tuple hash collides (found with a 2^33-step
# distinguished-point search); a 64-bit hash lets a user craft such a block against a known prompt.
COLLIDING_BLOCKS = (
    [0] * 8 + [4, 232, 111, 108, 165, 217, 27, 27],
    [0] * 8 + [33, 59, 226, 118, 58, 244, 152, 173],
)


def test_blocks_whose_python_hashes_collide_are_not_confused(live):
    # Bug fixed: the chain hash was Python's hash((parent, tokens)), so the second block "hit" the
    # first one's KV and a request was served another request's cache.
    first, second = COLLIDING_BLOCKS
    assert first != second and hash(tuple(first)) == hash(tuple(second)), "precondition: a real collision"
    assert chain_hash(None, tuple(first)) != chain_hash(None, tuple(second))
    bm = manager(live, 8, 16)
    a = make_seq([*first, 1])
    admit(bm, a)
    bm.free(a)
    assert bm.stats().cached == 1
    b = live(make_seq([*second, 1]))
    assert bm.allocate_prefix(b) == 0
    again = live(make_seq([*first, 2]))
    assert bm.allocate_prefix(again) == 16  # the same tokens still hit


def test_hit_rate_counts_recorded_lookups(live):
    bm = manager(live, 8, 2)
    assert bm.stats().hit_rate == 0.0
    bm.record_prefix_lookup(10, 0)
    bm.record_prefix_lookup(10, 6)
    stats = bm.stats()
    assert (stats.prefix_queries, stats.prefix_hits, stats.hit_rate) == (20, 6, 0.3)


def test_reset_prefix_cache_forgets_free_blocks_only(live):
    bm = manager(live, 8, 2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = live(make_seq([7, 7, 8, 8, 9]))
    admit(bm, b)
    bm.reset_prefix_cache()
    assert bm.stats().cached == 0
    assert bm.blocks[b.block_table[0]].hash is not None  # in use: keeps its hash
    assert bm.allocate_prefix(live(make_seq([1, 2, 3, 4, 5]))) == 0


def test_check_integrity_catches_a_wrong_ref_count(live):
    bm = BlockManager(4, 2)
    seq = make_seq([1, 2, 3])
    admit(bm, seq)
    bm.blocks[0].ref_count = 2
    with pytest.raises(AssertionError, match="block 0 ref count wrong"):
        bm.check_integrity([seq])
    bm.blocks[0].ref_count = 1
    seq.block_table.append(seq.block_table[0])
    with pytest.raises(AssertionError, match="owns a block twice"):
        bm.check_integrity([seq])


def test_a_pinned_block_outlives_its_sequence_until_unpinned(live):
    bm = manager(live, 6, 4)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    bm.pin(seq.block_table)
    bm.free(seq)
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0]
    assert bm.free_block_ids() == [3, 4, 5]
    assert (bm.stats().used, bm.stats().pinned) == (3, 3)
    # A new prompt with the same first block shares the pinned block and takes fresh ones for the rest.
    other = make_seq([0, 1, 2, 3, 7, 7, 7, 7, 7])
    assert admit(bm, other) == 4
    assert other.block_table == [0, 3, 4]
    bm.check_integrity([other])
    bm.free(other)
    bm.unpin([0, 1, 2])
    # Unpinned last block first, like `free`; full blocks keep their prefix-cache content.
    assert bm.free_block_ids() == [5, 4, 3, 2, 1, 0]
    assert (bm.stats().used, bm.stats().pinned, bm.stats().cached) == (0, 0, 3)


def test_pin_and_unpin_refuse_what_they_cannot_do_and_change_nothing(live):
    bm = manager(live, 4, 2)
    seq = live(make_seq([1, 2, 3]))
    admit(bm, seq)
    with pytest.raises(ValueError, match="block_ids: block 3 is free; only held blocks can be pinned"):
        bm.pin([0, 3])
    with pytest.raises(ValueError, match="block_ids: 9 is not a block of this cache"):
        bm.pin([9])
    assert ref_counts(bm) == [1, 1, 0, 0] and bm.pinned_references() == {}
    bm.pin([0, 0])
    with pytest.raises(ValueError, match="block_ids: block 0 is unpinned more often than pinned"):
        bm.unpin([0, 0, 0])
    assert bm.pinned_references() == {0: 2}
    bm.check_integrity([seq])
    bm.unpin([0, 0])
    assert ref_counts(bm) == [1, 1, 0, 0]


def test_check_integrity_counts_pinned_references(live):
    bm = BlockManager(4, 2)
    seq = make_seq([1, 2, 3])
    admit(bm, seq)
    bm.pin([1, 1])
    bm.check_integrity([seq])
    bm.blocks[1].ref_count = 2  # as if one pin's reference were lost
    with pytest.raises(AssertionError, match="block 1 ref count wrong"):
        bm.check_integrity([seq])
    bm.blocks[1].ref_count = 1  # fewer references than pins, whoever holds them
    with pytest.raises(AssertionError, match="block 1 pinned 2 times"):
        bm.check_integrity()


def test_prefix_block_hashes_are_what_commit_registers(live):
    bm = manager(live, 8, 4)
    seq = live(make_seq(list(range(11))))
    admit(bm, seq)
    hashes = prefix_block_hashes(list(range(11)), 4)
    assert len(hashes) == 2
    assert [bm.blocks[b].hash for b in seq.block_table[:2]] == hashes
    assert prefix_block_hashes([1, 2, 3], 4) == []


# ----- sliding window ------------------------------------------------------------------------------
def test_blocks_before_the_window_are_released_oldest_first(live):
    bm = manager(live, 8, 4, sliding_window=8)
    seq = live(make_seq(list(range(10, 30))))  # 20 tokens
    compute(bm, seq, 12)
    # The next query (position 12) sees 5..12: block 0 (tokens 0-3) is out, block 1 (4-7) is not.
    bm.release_outside_window(seq)
    assert seq.block_table == [RELEASED_BLOCK, 1, 2] and seq.num_released_blocks == 1
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 0]
    compute(bm, seq)
    bm.release_outside_window(seq)  # next query at 20 sees 13..20: blocks 0-2 are out
    assert seq.block_table == [RELEASED_BLOCK] * 3 + [3, 4]
    assert bm.free_block_ids() == [5, 6, 7, 0, 1, 2]
    assert bm.stats().used == 2
    # A released block keeps its prefix-cache hash: the same prompt finds all five blocks.
    other = live(make_seq(list(range(10, 30)) + [99]))
    assert bm.allocate_prefix(other) == 20
    assert other.block_table == [RELEASED_BLOCK] * 3 + [3, 4]  # and releases the first three at once
    bm.free(seq)
    assert seq.block_table == [] and seq.num_released_blocks == 0


def test_blocks_for_sequence_is_bounded_by_the_window_and_the_chunk():
    plain, windowed = BlockManager(64, 4), BlockManager(64, 4, sliding_window=8)
    assert plain.blocks_for_sequence(100, 16) == 25
    # A 16-token chunk whose first query looks 7 tokens back: 23 tokens over at most 7 blocks.
    assert windowed.blocks_for_sequence(100, 16) == 7
    assert windowed.blocks_for_sequence(10, 16) == 3


def test_check_integrity_catches_a_block_kept_outside_the_window(live):
    bm = BlockManager(8, 4, sliding_window=4)
    seq = make_seq(list(range(12)))
    compute(bm, seq)
    with pytest.raises(AssertionError, match="holds 2 blocks outside its window"):
        bm.check_integrity([seq])
    bm.release_outside_window(seq)
    bm.check_integrity([seq])
    seq.block_table[1] = 7
    with pytest.raises(AssertionError, match="released count wrong"):
        bm.check_integrity([seq])


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_rejects_an_empty_geometry(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        BlockManager(num_blocks, block_size)


# ----- holds of queued sequences -------------------------------------------------------------------
def test_a_queued_sequence_holds_its_cached_head_within_the_budget(live):
    bm = BlockManager(num_blocks=8, block_size=2)
    warm = make_seq([1, 2, 3, 4, 5, 6, 7])
    admit(bm, warm)
    cached = list(warm.block_table[:3])
    bm.free(warm)
    queued = make_seq([1, 2, 3, 4, 5, 6, 9])
    assert bm.hold_prefix(queued, budget=2) == 2
    assert bm.held_blocks(queued) == cached[:2]  # the head; the third block is only touched
    assert bm.free_block_ids()[-1] == cached[2]
    assert [bm.blocks[b].ref_count for b in cached] == [1, 1, 0]
    assert (bm.stats().held, bm.stats().used) == (2, 2)
    # Allocations can no longer evict them: everything else in the cache is taken.
    hog = live(make_seq([40] * 12))
    assert bm.ensure_slots(hog, 12) and bm.num_free_blocks == 0
    bm.check_integrity([hog])
    bm.free(hog)
    assert bm.allocate_prefix(queued) == 4  # the held blocks pass to its table
    assert queued.block_table == cached[:2] and bm.num_held_blocks == 0
    assert [bm.blocks[b].ref_count for b in cached[:2]] == [1, 1]
    bm.free(queued)
    assert bm.stats().used == 0


def test_a_hold_is_released_by_free_and_by_release_hold():
    bm = BlockManager(num_blocks=8, block_size=2)
    warm = make_seq([1, 2, 3, 4, 5])
    admit(bm, warm)
    bm.free(warm)
    first, second = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 6])
    assert (bm.hold_prefix(first, 8), bm.hold_prefix(second, 8)) == (2, 2)
    assert bm.num_held_blocks == 4
    assert bm.hold_prefix(first, 8) == 2  # a second hold replaces the first
    assert bm.num_held_blocks == 4
    bm.free(first)  # an aborted waiting sequence
    assert bm.release_hold(second) == 2 and bm.release_hold(second) == 0
    assert (bm.stats().used, bm.stats().held, bm.stats().cached) == (0, 0, 2)
    bm.check_integrity([])


def test_nothing_is_held_when_admission_would_reuse_nothing():
    bm = BlockManager(num_blocks=8, block_size=2)
    warm = make_seq([1, 2, 3, 4, 5])
    admit(bm, warm)
    bm.free(warm)
    assert bm.hold_prefix(make_seq([1, 2, 3, 4, 5], prompt_logprobs=1), 8) == 0
    assert bm.hold_prefix(make_seq([9, 2, 3, 4, 5]), 8) == 0
    off = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    assert off.hold_prefix(make_seq([1, 2, 3, 4, 5]), 8) == 0
    assert bm.num_held_blocks == 0


def test_check_integrity_counts_the_holds():
    bm = BlockManager(num_blocks=8, block_size=2)
    warm = make_seq([1, 2, 3, 4, 5])
    admit(bm, warm)
    bm.free(warm)
    queued = make_seq([1, 2, 3, 4, 5])
    bm.hold_prefix(queued, 8)
    bm.check_integrity([])
    bm.blocks[bm.held_blocks(queued)[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref count wrong"):
        bm.check_integrity([])


# ----- property tests ------------------------------------------------------------------------------
# Tokens come from a tiny alphabet over a few shared stems, so random sequences share prefixes often.
STEMS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [4, 4, 4, 4])
BLOCK_SIZE = 2
NUM_BLOCKS = 10


def fingerprint(seq: Sequence, pos: int) -> tuple[int, ...]:
    return tuple(seq.token_ids[: pos + 1])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, chunks, sampled tokens, frees and preemptions against a model of the KV slots."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.seqs: list[Sequence] = []
        self.kv: dict[int, tuple[int, ...]] = {}
        # Pins of finished sequences (a produced KV transfer): blocks, and the slots' content when pinned.
        self.pins: list[tuple[list[int], dict[int, tuple[int, ...]]]] = []
        self.queued: list[Sequence] = []  # waiting sequences holding their cached prefix
        self.budget = 4

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def _compute(self, seq: Sequence, num_tokens: int) -> bool:
        start = seq.num_computed_tokens
        end = min(seq.num_tokens, start + num_tokens)
        if end == start or not self.bm.ensure_slots(seq, end):
            return False
        for pos in range(start, end):
            block = self.bm.blocks[seq.block_table[pos // BLOCK_SIZE]]
            assert block.ref_count == 1, f"write into shared block {block.block_id}"
            assert block.hash is None, f"write into published block {block.block_id}"
            self.kv[self._slot(seq, pos)] = fingerprint(seq, pos)
        seq.num_computed_tokens = end
        self.bm.commit_computed_blocks(seq)
        return True

    @rule(
        target=held,
        stem=st.sampled_from(STEMS),
        cut=st.integers(0, 8),
        tail=st.lists(st.integers(0, 3), max_size=4),
        chunk=st.integers(1, 8),
    )
    def admit(self, stem, cut, tail, chunk):
        prompt = stem[:cut] + tail or [0]
        seq = make_seq(prompt)
        reused = self.bm.allocate_prefix(seq)
        assert reused % BLOCK_SIZE == 0 and reused < seq.num_tokens
        if not self._compute(seq, chunk):
            self.bm.free(seq)  # did not fit: the scheduler gives everything back
            return None
        self.seqs.append(seq)
        return seq

    @rule(seq=held, chunk=st.integers(1, 6))
    def advance(self, seq, chunk):
        if seq in self.seqs:
            self._compute(seq, chunk)

    @rule(seq=held, token=st.integers(0, 9))
    def sample(self, seq, token):
        if seq in self.seqs and seq.num_uncomputed_tokens == 0 and seq.num_tokens < 24:
            seq.append_token(token)

    @rule(seq=consumes(held))
    def finish(self, seq):
        if seq in self.seqs:
            self.seqs.remove(seq)
            self.bm.free(seq)

    @rule(seq=held, chunk=st.integers(1, 8))
    def preempt_and_resume(self, seq, chunk):
        if seq not in self.seqs:
            return
        self.bm.free(seq)
        self.bm.allocate_prefix(seq)
        if not self._compute(seq, chunk):
            self.bm.free(seq)
            self.seqs.remove(seq)

    @rule(seq=consumes(held))
    def finish_pinned(self, seq):
        """A prefill that hands its KV off: pin the computed tokens' blocks, then the sequence ends."""
        if seq not in self.seqs or seq.num_computed_tokens == 0:
            return
        blocks = seq.block_table[: self.bm.blocks_needed(seq.num_computed_tokens)]
        content = {self._slot(seq, p): fingerprint(seq, p) for p in range(seq.num_computed_tokens)}
        self.bm.pin(blocks)
        self.pins.append((blocks, content))
        self.seqs.remove(seq)
        self.bm.free(seq)

    @rule(data=st.data())
    def unpin(self, data):
        if self.pins:
            blocks, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
            self.bm.unpin(blocks)

    @rule(stem=st.sampled_from(STEMS), cut=st.integers(0, 8), tail=st.lists(st.integers(0, 3), max_size=4))
    def queue(self, stem, cut, tail):
        seq = make_seq(stem[:cut] + tail or [0])
        self.bm.hold_prefix(seq, self.budget)
        self.queued.append(seq)

    @rule(data=st.data(), chunk=st.integers(1, 8))
    def admit_queued(self, data, chunk):
        if not self.queued:
            return
        seq = self.queued.pop(data.draw(st.integers(0, len(self.queued) - 1)))
        held = len(self.bm.held_blocks(seq))
        reused = self.bm.allocate_prefix(seq)
        assert reused >= held * BLOCK_SIZE, "a held block was evicted"
        assert not self.bm.held_blocks(seq)
        if self._compute(seq, chunk):
            self.seqs.append(seq)
        else:
            self.bm.free(seq)

    @rule(data=st.data(), release=st.booleans())
    def abort_queued(self, data, release):
        if not self.queued:
            return
        seq = self.queued.pop(data.draw(st.integers(0, len(self.queued) - 1)))
        if release:
            self.bm.release_hold(seq)
        else:
            self.bm.free(seq)

    @invariant()
    def invariants_hold(self):
        self.bm.check_integrity(self.seqs)
        stats = self.bm.stats()
        free = self.bm.free_block_ids()
        assert stats.used + stats.free == stats.total == NUM_BLOCKS
        assert stats.free == len(free) == len(set(free))
        # cached ⊆ free: the cached count is exactly the free blocks still holding content
        assert stats.cached == sum(1 for b in free if self.bm.blocks[b].hash is not None)
        owners: dict[int, int] = {}
        holds = [b for seq in self.queued for b in self.bm.held_blocks(seq)]
        assert len(holds) == stats.held <= self.budget
        assert all(self.bm.blocks[b].hash is not None for b in holds), "a held block lost its content"
        for block_id in (
            [b for seq in self.seqs for b in seq.block_table] + [b for p in self.pins for b in p[0]] + holds
        ):
            owners[block_id] = owners.get(block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == owners.get(block.block_id, 0)
            if block.ref_count > 1:
                assert block.hash is not None, "only full, published blocks are shared"
        # What attention would read: every computed position holds this sequence's own prefix.
        for seq in self.seqs:
            for pos in range(seq.num_computed_tokens):
                assert self.kv.get(self._slot(seq, pos)) == fingerprint(seq, pos)
        # Pinned blocks are neither freed nor reused: their slots still hold what was pinned.
        assert stats.pinned == len({b for blocks, _ in self.pins for b in blocks})
        for _, content in self.pins:
            assert all(self.kv.get(slot) == value for slot, value in content.items())


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_random_operations = BlockManagerMachine.TestCase
