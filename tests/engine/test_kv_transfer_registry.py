"""KV transfer bookkeeping without torch: the source's registry (pins, pulls, release, leases), the
destination's pull plan (prefix-cache hits → start_block, commit, recompute fallback) and the layout
fingerprint. Every test ends with the BlockManager's and the registry's integrity checks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conduit_engine.core.block_manager import BlockManager, prefix_block_hashes
from conduit_engine.core.sequence import Sequence
from conduit_engine.errors import InvalidRequestError
from conduit_engine.kv_transfer.errors import KvTransferNotFoundError
from conduit_engine.kv_transfer.layout import KvLayoutSpec, layout_fingerprint
from conduit_engine.kv_transfer.pull_plan import (
    KvPullCounters,
    abandon_pull,
    commit_pull,
    plan_pull,
)
from conduit_engine.kv_transfer.registry import KvTransferRegistry
from conduit_engine.sampling_params import SamplingParams
from tests.support.clock import ManualClock

pytestmark = pytest.mark.unit

LEASE = 30.0
T0 = 1_800_000_000.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def source(clock):
    bm = BlockManager(8, 4)
    registry = KvTransferRegistry(bm, lease_seconds=LEASE, clock=clock)
    yield bm, registry
    registry.check_integrity()
    bm.check_integrity([])
    stats = bm.stats()
    assert stats.used + stats.free == stats.total


def prefilled(bm: BlockManager, prompt: list[int]) -> Sequence:
    """A prefill that computed its prompt and sampled its first token (still holding its blocks)."""
    seq = Sequence("p", list(prompt), SamplingParams(max_tokens=4))
    bm.allocate_prefix(seq)
    assert bm.ensure_slots(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.commit_computed_blocks(seq)
    seq.append_token(99)
    return seq


def produce(bm: BlockManager, registry: KvTransferRegistry, prompt: list[int]):
    """What the prefill engine does at the first token: pin the prompt's blocks, then end the sequence."""
    seq = prefilled(bm, prompt)
    transfer = registry.produce(seq.block_table[: bm.blocks_needed(len(prompt))], prompt)
    bm.free(seq)
    return transfer


# ----- the source's registry ----------------------------------------------------------------------------


def test_produce_pins_the_prompt_blocks_past_the_end_of_their_sequence(source):
    bm, registry = source
    transfer = produce(bm, registry, list(range(10)))
    assert transfer.block_ids == (0, 1, 2) and transfer.num_tokens == 10 and transfer.num_blocks == 3
    assert re.fullmatch(r"[0-9a-f]{32}", transfer.transfer_id)
    assert transfer.block_hashes == tuple(prefix_block_hashes(list(range(10)), 4))
    assert transfer.expires_unix_ms == int((T0 + LEASE) * 1000)
    assert (bm.stats().used, bm.stats().pinned) == (3, 3)
    assert (registry.num_pending, registry.num_pinned_blocks) == (1, 3)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]  # pinned blocks are not free, so never reused
    other = produce(bm, registry, list(range(10)))
    assert other.transfer_id != transfer.transfer_id
    assert other.block_ids == (0, 1, 3)  # the full blocks are shared through the prefix cache
    assert (registry.num_pinned_blocks, bm.pinned_references()) == (4, {0: 2, 1: 2, 2: 1, 3: 1})
    registry.check_integrity()
    assert registry.release(transfer.transfer_id) and registry.release(other.transfer_id)
    assert (bm.stats().used, bm.stats().pinned, bm.stats().cached) == (0, 0, 2)


def test_a_completed_pull_frees_the_blocks_and_the_id_is_gone(source):
    bm, registry = source
    transfer = produce(bm, registry, list(range(6)))
    assert registry.start_pull(transfer.transfer_id) is transfer
    registry.check_integrity()
    registry.finish_pull(transfer.transfer_id, completed=True)
    assert (bm.stats().used, registry.num_pending, registry.transfer_ids()) == (0, 0, [])
    with pytest.raises(KvTransferNotFoundError, match=f"transfer_id: '{transfer.transfer_id}' is unknown"):
        registry.start_pull(transfer.transfer_id)
    assert not registry.release(transfer.transfer_id)


def test_release_frees_once_and_unknown_ids_are_no_error(source):
    bm, registry = source
    transfer = produce(bm, registry, list(range(5)))
    assert registry.release(transfer.transfer_id)
    assert not registry.release(transfer.transfer_id)
    assert not registry.release("no-such-transfer")
    assert bm.stats().used == 0


def test_the_lease_ends_the_transfer_exactly_at_its_expiry(source, clock):
    bm, registry = source
    transfer = produce(bm, registry, list(range(9)))
    clock.now = T0 + LEASE - 0.001
    assert registry.expire_due() == []
    clock.now = T0 + LEASE
    assert registry.expire_due() == [transfer.transfer_id]
    assert bm.stats().used == 0 and registry.num_pending == 0


def test_an_expired_lease_is_seen_at_lookup_without_expire_due(source, clock):
    bm, registry = source
    transfer = produce(bm, registry, list(range(9)))
    clock.now = T0 + LEASE + 5
    with pytest.raises(KvTransferNotFoundError):
        registry.start_pull(transfer.transfer_id)
    assert bm.stats().used == 0


@pytest.mark.parametrize("end", ["release", "expire"])
def test_a_pull_in_flight_keeps_the_blocks_of_an_ended_transfer_until_it_finishes(source, clock, end):
    bm, registry = source
    transfer = produce(bm, registry, list(range(9)))
    registry.start_pull(transfer.transfer_id)
    if end == "release":
        assert registry.release(transfer.transfer_id)
    else:
        clock.now = T0 + LEASE
        assert registry.expire_due() == [transfer.transfer_id]
    assert registry.num_pending == 0 and bm.stats().pinned == 3  # still being read
    with pytest.raises(KvTransferNotFoundError):
        registry.start_pull(transfer.transfer_id)
    registry.check_integrity()
    registry.finish_pull(transfer.transfer_id, completed=False)
    assert bm.stats().used == 0 and registry.transfer_ids() == []


def test_a_failed_pull_leaves_the_transfer_pullable_until_its_lease_ends(source, clock):
    bm, registry = source
    first = produce(bm, registry, list(range(9)))
    registry.start_pull(first.transfer_id)
    registry.finish_pull(first.transfer_id, completed=False)
    assert registry.num_pending == 1
    registry.start_pull(first.transfer_id)
    registry.finish_pull(first.transfer_id, completed=True)
    second = produce(bm, registry, list(range(20, 29)))
    registry.start_pull(second.transfer_id)
    clock.now = T0 + LEASE
    registry.finish_pull(second.transfer_id, completed=False)  # failed after the lease: freed now
    assert bm.stats().used == 0


def test_concurrent_pulls_unpin_when_the_last_one_ends(source):
    bm, registry = source
    transfer = produce(bm, registry, list(range(6)))
    registry.start_pull(transfer.transfer_id)
    registry.start_pull(transfer.transfer_id)
    registry.finish_pull(transfer.transfer_id, completed=True)
    assert registry.num_pending == 0 and bm.stats().pinned == 2
    registry.finish_pull(transfer.transfer_id, completed=False)
    assert bm.stats().used == 0
    with pytest.raises(ValueError, match="transfer_id: no pull of"):
        registry.finish_pull(transfer.transfer_id, completed=True)


def test_produce_refuses_blocks_that_do_not_match_the_tokens_and_pins_nothing(source):
    bm, registry = source
    seq = prefilled(bm, list(range(9)))
    with pytest.raises(ValueError, match="block_ids: 9 tokens take 3 blocks, got 2"):
        registry.produce(seq.block_table[:2], list(range(9)))
    with pytest.raises(ValueError, match="token_ids: a transfer holds at least one token"):
        registry.produce([], [])
    with pytest.raises(ValueError, match="block_ids: a block appears twice"):
        registry.produce([0, 0, 1], list(range(9)))
    with pytest.raises(ValueError, match="block 5 is free"):
        registry.produce([0, 1, 5], list(range(9)))
    assert bm.pinned_references() == {}
    bm.free(seq)


def test_release_all_and_the_integrity_check_against_a_pin_behind_its_back(source):
    bm, registry = source
    transfers = [produce(bm, registry, [i] * 5) for i in range(3)]
    bm.pin(transfers[0].block_ids[:1])  # a pin nobody will ever release
    with pytest.raises(AssertionError, match="pins differ from the live transfers"):
        registry.check_integrity()
    bm.unpin(transfers[0].block_ids[:1])
    assert registry.release_all() == 3
    assert registry.release_all() == 0
    assert bm.stats().pinned == 0


def test_lease_must_be_positive():
    with pytest.raises(ValueError, match="lease_seconds: must be > 0"):
        KvTransferRegistry(BlockManager(2, 2), lease_seconds=0)


# ----- the destination's pull plan ----------------------------------------------------------------------


def consume_seq(prompt: list[int], first_token: int = 7) -> Sequence:
    seq = Sequence("d", list(prompt), SamplingParams(max_tokens=4))
    seq.append_token(first_token)
    return seq


def test_a_cold_cache_pulls_every_block_and_commit_publishes_the_prefix():
    bm = BlockManager(16, 4)
    seq = consume_seq(list(range(10)))
    plan = plan_pull(bm, seq, 10)
    assert plan is not None
    assert (plan.start_block, plan.total_blocks, plan.num_pull_blocks) == (0, 3, 3)
    assert plan.dest_block_ids == [0, 1, 2] and seq.num_computed_tokens == 0
    commit_pull(bm, plan)
    assert seq.num_computed_tokens == 10 and seq.num_uncomputed_tokens == 1  # next: the first token
    assert [bm.blocks[b].hash for b in seq.block_table[:2]] == prefix_block_hashes(list(range(10)), 4)
    counters = KvPullCounters()
    counters.record(plan, block_bytes=1000)
    assert (counters.bytes_pulled, counters.bytes_saved) == (3000, 0)
    # The same prompt again: both full blocks are prefix-cache hits; only the partial block is pulled.
    again = consume_seq(list(range(10)), first_token=8)
    plan2 = plan_pull(bm, again, 10)
    assert plan2 is not None
    assert (plan2.start_block, plan2.dest_block_ids) == (2, [3])
    assert again.block_table == [0, 1, 3]
    commit_pull(bm, plan2)
    counters.record(plan2, block_bytes=1000)
    assert (counters.bytes_pulled, counters.bytes_saved) == (4000, 2000)
    bm.check_integrity([seq, again])


def test_a_block_aligned_prompt_already_cached_pulls_nothing():
    bm = BlockManager(16, 4)
    first = consume_seq(list(range(8)))
    plan = plan_pull(bm, first, 8)
    assert plan is not None and plan.total_blocks == 2
    commit_pull(bm, plan)
    bm.free(first)
    second = consume_seq(list(range(8)))
    plan = plan_pull(bm, second, 8)
    assert plan is not None and (plan.start_block, plan.num_pull_blocks, plan.dest_block_ids) == (2, 0, [])
    commit_pull(bm, plan)
    assert second.num_computed_tokens == 8
    bm.check_integrity([second])


def test_too_few_free_blocks_gives_no_plan_and_holds_nothing():
    bm = BlockManager(2, 4)
    seq = consume_seq(list(range(10)))
    assert plan_pull(bm, seq, 10) is None
    assert seq.block_table == [] and bm.stats().used == 0


def test_the_handle_must_hold_the_prompt_it_is_sent_with():
    bm = BlockManager(4, 4)
    with pytest.raises(
        InvalidRequestError, match="kv_transfer.consume.handle.num_tokens: the handle holds 5"
    ):
        plan_pull(bm, consume_seq(list(range(6))), 5)
    with pytest.raises(ValueError, match="seq: expected a new sequence holding its prompt and exactly"):
        plan_pull(bm, Sequence("d", [1, 2, 3], SamplingParams()), 3)
    assert bm.stats().used == 0


def test_abandon_rewinds_to_the_prefix_cache_hit_and_keeps_the_blocks():
    bm = BlockManager(16, 4)
    warm = consume_seq(list(range(10)))
    plan = plan_pull(bm, warm, 10)
    assert plan is not None
    commit_pull(bm, plan)
    seq = consume_seq(list(range(8)) + [50, 51, 52])
    plan = plan_pull(bm, seq, 11)
    assert plan is not None and plan.start_block == 2
    abandon_pull(bm, plan)
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 3
    assert bm.blocks[seq.block_table[2]].hash is None  # nothing half-written was published
    bm.check_integrity([warm, seq])


# ----- the layout fingerprint ---------------------------------------------------------------------------


def test_the_fingerprint_covers_every_field_and_is_stable():
    spec = KvLayoutSpec("stories260K", "float32", 16, 5, 4, 8)
    assert spec.fingerprint == layout_fingerprint("stories260K", "float32", 16, 5, 4, 8)
    assert re.fullmatch(r"[0-9a-f]{64}", spec.fingerprint)
    variants = [
        KvLayoutSpec("other", "float32", 16, 5, 4, 8),
        KvLayoutSpec("stories260K", "bfloat16", 16, 5, 4, 8),
        KvLayoutSpec("stories260K", "float32", 32, 5, 4, 8),
        KvLayoutSpec("stories260K", "float32", 16, 6, 4, 8),
        KvLayoutSpec("stories260K", "float32", 16, 5, 2, 8),
        KvLayoutSpec("stories260K", "float32", 16, 5, 4, 16),
        KvLayoutSpec("stories260K", "int8", 16, 5, 4, 8),
        KvLayoutSpec("stories260K", "fp8_e4m3", 16, 5, 4, 8),
    ]
    assert len({spec.fingerprint, *(v.fingerprint for v in variants)}) == 9
    assert spec.block_bytes == 2 * 5 * 16 * 4 * 8 * 4
    # quantized: a byte per value plus each (token, head) row's bfloat16 scale
    assert variants[-1].block_bytes == variants[-2].block_bytes == 2 * 5 * 16 * 4 * (8 + 2)
    assert spec.num_blocks(33) == 3
    # Stable across processes (no per-process hash seed): another interpreter computes the same value.
    code = (
        "from conduit_engine.kv_transfer.layout import layout_fingerprint as f;"
        "print(f('stories260K', 'float32', 16, 5, 4, 8))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == spec.fingerprint


def test_layout_fields_are_validated_by_name():
    with pytest.raises(
        ValueError, match="dtype: expected one of float32, float16, bfloat16, int8, fp8_e4m3, got 'int4'"
    ):
        KvLayoutSpec("m", "int4", 16, 1, 1, 8)
    with pytest.raises(ValueError, match="head_dim: must be >= 1, got 0"):
        KvLayoutSpec("m", "float32", 16, 1, 1, 0)


def test_the_bookkeeping_modules_do_not_import_torch():
    code = (
        "import sys; import conduit_engine.kv_transfer.registry, conduit_engine.kv_transfer.pull_plan, "
        "conduit_engine.kv_transfer.layout, conduit_engine.kv_transfer.errors; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
