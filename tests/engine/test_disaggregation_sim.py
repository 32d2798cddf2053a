"""Prefill/decode disaggregation on the model-free simulator (tests/engine/support/sched_sim.py; no torch).

A prefill SimEngine runs requests with `produce=True` through the engine's KvProducer: each choice ends at
its first token with the prompt's blocks pinned. A decode SimEngine consumes the handle through the
engine's KvConsumer: it pulls the blocks it lacks (the simulator copies KV slots), commits them and decodes
on. Every step checks that pinned blocks are neither freed nor reused, that the pins are exactly the live
transfers', and that free + used == total; the decode engine's reads check that every position holds its
own prefix, so a wrong start_block or a misplaced block fails.
"""

from __future__ import annotations

import pytest

from conduit_engine.core.sequence import FinishReason
from conduit_engine.errors import QueueFullError
from tests.engine.support.sched_sim import SimEngine, reference_output
from tests.support.clock import ManualClock

pytestmark = pytest.mark.unit

BLOCK = 4
LEASE = 30.0


def prefill_engine(num_blocks: int = 64, clock: ManualClock | None = None, **kw) -> SimEngine:
    return SimEngine(
        num_blocks=num_blocks, block_size=BLOCK, kv_lease_seconds=LEASE, clock=clock or ManualClock(), **kw
    )


def decode_engine(num_blocks: int = 64, **kw) -> SimEngine:
    return SimEngine(num_blocks=num_blocks, block_size=BLOCK, **kw)


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 31 + i * 7) % 97 for i in range(length)]


def handoff(prefill: SimEngine, request_id: str, prompt: list[int], n: int = 1) -> list[int]:
    """Run the prefill side; returns each choice's first token (its whole stream there)."""
    prefill.add(request_id, prompt, max_tokens=16, n=n, produce=True)
    prefill.run()
    names = [request_id] + [f"{request_id}/{i}" for i in range(1, n)]
    firsts = [prefill.streams[name] for name in names]
    assert all(len(tokens) == 1 for tokens in firsts)
    assert all(prefill.seqs[name].finish_reason.name == "KV_HANDOFF" for name in names)
    return [tokens[0] for tokens in firsts]


@pytest.mark.parametrize("length", [1, 3, 4, 9, 16, 23])
def test_decode_continues_from_the_pulled_kv_exactly_as_one_engine_would(length):
    prefill, decode = prefill_engine(), decode_engine()
    prompt = prompt_of(length, length)
    want = reference_output(prompt, 12)
    first = handoff(prefill, "r", prompt)
    assert first == want[:1]
    transfer = prefill.handoffs["r"]
    assert transfer.num_blocks == -(-length // BLOCK)
    assert prefill.block_manager.stats().used == transfer.num_blocks  # pinned after the prefill ended
    assert decode.consume("r", prompt, first, 12, source=prefill) == "pulled"
    assert prefill.block_manager.stats().used == 0 and prefill.registry.num_pending == 0
    decode.run()
    assert decode.streams["r"] == want[1:]
    # The decode engine computed only the first token: the prompt came over the transport.
    assert sum(step.advanced.get("r", 0) for step in decode.steps) == 12 - 1
    block = decode.layout.block_bytes
    assert (decode.consumer.counters.bytes_pulled, decode.consumer.counters.bytes_saved) == (
        transfer.num_blocks * block,
        0,
    )


def test_pinned_blocks_survive_cache_pressure_and_preemptions_until_pulled():
    prefill = prefill_engine(num_blocks=14, max_num_seqs=4)
    prompt = prompt_of(1, 10)
    first = handoff(prefill, "pd", prompt)
    pinned = set(prefill.handoffs["pd"].block_ids)
    # Colocated work that wants more blocks than are free: it must preempt itself, never take a pin.
    for i in range(4):
        prefill.add(f"local{i}", prompt_of(10 + i, 7), max_tokens=14)
    records = prefill.run()
    assert any(r.preempted for r in records)
    for i in range(4):
        assert prefill.streams[f"local{i}"] == reference_output(prompt_of(10 + i, 7), 14)
    assert pinned.isdisjoint(prefill.block_manager.free_block_ids())
    decode = decode_engine()
    assert decode.consume("pd", prompt, first, 6, source=prefill) == "pulled"
    decode.run()
    assert decode.streams["pd"] == reference_output(prompt, 6)[1:]
    assert prefill.block_manager.stats().used == 0


def test_decode_side_prefix_hits_are_not_pulled_and_count_as_saved():
    prefill, decode = prefill_engine(), decode_engine()
    shared = prompt_of(3, 12)  # three full blocks
    a, b = shared + [1, 2], shared + [5, 6, 7, 8, 9]
    first_a = handoff(prefill, "a", a)
    assert decode.consume("a", a, first_a, 5, source=prefill) == "pulled"
    decode.run()
    first_b = handoff(prefill, "b", b)
    assert decode.consume("b", b, first_b, 5, source=prefill) == "pulled"
    decode.run()
    assert decode.streams["b"] == reference_output(b, 5)[1:]
    # a: 4 blocks pulled. b: its 3 shared blocks were cached on the decode engine, 2 pulled.
    block = decode.layout.block_bytes
    assert (decode.consumer.counters.bytes_pulled, decode.consumer.counters.bytes_saved) == (
        6 * block,
        3 * block,
    )
    assert prefill.block_manager.stats().used == 0 == decode.block_manager.stats().used


@pytest.mark.parametrize("gone", ["released", "expired"])
def test_a_transfer_gone_before_the_pull_is_recomputed_with_identical_tokens(gone):
    clock = ManualClock()
    prefill, decode = prefill_engine(clock=clock), decode_engine()
    cached = prompt_of(4, 8)
    warm = handoff(prefill, "warm", cached + [3])
    decode.consume("warm", cached + [3], warm, 3, source=prefill)
    decode.run()
    prompt = cached + [9, 9, 9, 9, 9]
    first = handoff(prefill, "r", prompt)
    if gone == "released":
        assert prefill.registry.release(prefill.handoffs["r"].transfer_id)
    else:
        clock.now += LEASE
        prefill.add("other", [1, 2, 3], max_tokens=1)
        prefill.run()  # its step expires the lease
    assert prefill.block_manager.stats().used == 0
    steps_before = len(decode.steps)
    assert decode.consume("r", prompt, first, 10, source=prefill) == "recompute"
    decode.run()
    assert decode.streams["r"] == reference_output(prompt, 10)[1:]
    # It recomputed the prompt after its prefix-cache hit (two blocks) plus the first token.
    first_step = decode.steps[steps_before]
    assert first_step.advanced["r"] == len(prompt) + 1 - 8
    assert decode.consumer.counters.bytes_saved == 0 and decode.block_manager.stats().used == 0


def test_n_choices_share_one_transfer_and_decode_as_siblings():
    prefill, decode = prefill_engine(), decode_engine()
    prompt = prompt_of(7, 10)
    firsts = handoff(prefill, "n2", prompt, n=2)
    assert len(prefill.handoffs) == 1  # pinned once, by the first choice
    assert prefill.block_manager.stats().used == prefill.handoffs["n2"].num_blocks
    assert decode.consume("n2", prompt, firsts, 6, source=prefill) == "pulled"
    decode.run()
    want = reference_output(prompt, 6)[1:]
    assert decode.streams["n2"] == want == decode.streams["n2/1"]
    assert prefill.block_manager.stats().used == 0 == decode.block_manager.stats().used


def test_many_transfers_pending_at_once_keep_free_plus_used_equal_to_total():
    clock = ManualClock()
    prefill = prefill_engine(num_blocks=40, clock=clock)
    decode = decode_engine(num_blocks=40)
    prompts = {f"r{i}": prompt_of(20 + i, 3 + 2 * i) for i in range(6)}
    for rid, prompt in prompts.items():
        prefill.add(rid, prompt, max_tokens=8, produce=True)
    prefill.run()
    assert prefill.registry.num_pending == 6
    assert prefill.block_manager.stats().used == prefill.registry.num_pinned_blocks
    for rid in ("r0", "r2", "r4"):
        decode.consume(rid, prompts[rid], prefill.streams[rid], 8, source=prefill)
    assert prefill.registry.release(prefill.handoffs["r1"].transfer_id)
    clock.now += LEASE  # r3 and r5 were never pulled: their leases free them at the next step
    prefill.add("tick", [1], max_tokens=1)
    prefill.run()
    decode.run()
    for rid in ("r0", "r2", "r4"):
        assert decode.streams[rid] == reference_output(prompts[rid], 8)[1:]
    assert prefill.registry.num_pending == 0 and prefill.block_manager.stats().used == 0
    assert decode.block_manager.stats().used == 0


def test_a_prefill_whose_every_choice_stops_at_its_first_token_releases_the_transfer_at_once():
    prefill = prefill_engine()
    prefill.add("short", prompt_of(8, 9), max_tokens=1, n=2, produce=True)
    prefill.run()
    assert [prefill.seqs[name].finish_reason for name in ("short", "short/1")] == [FinishReason.LENGTH] * 2
    assert prefill.registry.num_pending == 0 and prefill.block_manager.stats().used == 0


def test_only_the_choices_the_prefill_left_running_are_decoded():
    prefill, decode = prefill_engine(), decode_engine()
    prompt = prompt_of(9, 11)
    firsts = handoff(prefill, "sub", prompt, n=2)
    # Choice 0 ended on the prefill engine (say at a stop string): only choice 1 continues; it pulls.
    decode.start_consume("sub", prompt, firsts[1:], 6, source=prefill, indices=[1])
    assert decode.end_pull("sub", source=prefill) == "pulled"
    decode.run()
    assert decode.streams["sub/1"] == reference_output(prompt, 6)[1:]
    assert "sub" not in decode.seqs and decode.block_manager.stats().used == 0


def test_a_request_aborted_while_its_pull_runs_keeps_the_blocks_until_the_pull_ends():
    prefill, decode = prefill_engine(), decode_engine(num_blocks=16)
    prompt = prompt_of(10, 13)  # 4 blocks
    firsts = handoff(prefill, "gone", prompt, n=2)
    pending = decode.start_consume("gone", prompt, firsts, 8, source=prefill)
    decode.abort_pulling("gone")
    # Both choices ended, but the pull may still write into the first one's blocks: they stay taken.
    assert all(decode.seqs[name].is_finished for name in ("gone", "gone/1"))
    assert set(pending.dest_block_ids).isdisjoint(decode.block_manager.free_block_ids())
    assert decode.block_manager.stats().used == 4
    decode.end_pull("gone", source=prefill)
    assert decode.block_manager.stats().used == 0 and not decode.consumer.held_sequences()
    assert not decode.scheduler.has_work()


def test_no_room_for_the_pull_refuses_the_request_and_holds_nothing():
    prefill, decode = prefill_engine(), decode_engine(num_blocks=6)
    decode.add("busy", prompt_of(11, 17), max_tokens=2)  # 5 blocks once admitted
    decode.step()
    prompt = prompt_of(12, 10)  # 3 blocks: only one is free
    first = handoff(prefill, "late", prompt)
    with pytest.raises(QueueFullError, match=r"no room for the pulled prompt now \(3 blocks, 1 free\)"):
        decode.start_consume("late", prompt, first, 4, source=prefill)
    decode.check_invariants()
    assert decode.block_manager.stats().used == 5 and decode.consumer.pending("late") is None
    decode.run()
    assert prefill.registry.num_pending == 1  # still pinned: another decode engine can take it
    other = decode_engine()
    assert other.consume("late", prompt, first, 4, source=prefill) == "pulled"
    other.run()
    assert other.streams["late"] == reference_output(prompt, 4)[1:]


def test_siblings_recompute_with_the_first_choice_when_the_transfer_is_gone():
    prefill, decode = prefill_engine(), decode_engine()
    prompt = prompt_of(13, 18)
    firsts = handoff(prefill, "lost", prompt, n=2)
    assert prefill.registry.release(prefill.handoffs["lost"].transfer_id)
    assert decode.consume("lost", prompt, firsts, 7, source=prefill) == "recompute"
    records = decode.run()
    want = reference_output(prompt, 7)[1:]
    assert decode.streams["lost"] == want == decode.streams["lost/1"]
    # The first choice recomputed the prompt and its first token; the second only its tail and first token.
    assert records[0].advanced == {"lost": 19}
    assert sum(r.advanced.get("lost/1", 0) for r in records[:2]) == 18 + 1 - 16
