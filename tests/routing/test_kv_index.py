"""The KV index, the kv_aware score and the event subscriber's gap handling, on plain objects (no engines):
exact block counts and chosen engines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from conduit.engine.v1 import engine_pb2
from conduit_common.kv_blocks import prefix_block_hashes
from conduit_gateway.routing.kv_events import KvEventSubscriber
from conduit_gateway.routing.kv_index import KvIndex
from conduit_gateway.routing.selection import RouteRequest, SelectionOptions, make_selector

pytestmark = pytest.mark.unit

BS = 4
TOKENS = tuple(range(1, 22))  # 21 tokens: the engine may reuse (21 - 1) // 4 = 5 blocks
HASHES = prefix_block_hashes(TOKENS, BS)


@dataclass
class Node:
    address: str
    kv_active_blocks: int = 0
    in_flight: int = 0
    load_score: int = 0
    token_latency_s: float | None = None
    block_size: int | None = BS


def index_with(**blocks: int) -> KvIndex:
    """An index where engine NAME holds the first N blocks of TOKENS."""
    index = KvIndex(max_blocks_per_engine=100)
    for address, count in blocks.items():
        entry = index.engine(address)
        entry.hashes = set(HASHES[:count])
        entry.current = True
    return index


def test_overlap_counts_leading_blocks_up_to_the_first_missing_one():
    index = index_with(a=3)
    assert index.overlap("a", HASHES) == 3
    index.engine("a").hashes.discard(HASHES[1])
    assert index.overlap("a", HASHES) == 1
    assert index.overlap("unknown", HASHES) == 0


def test_an_engine_that_is_not_current_holds_nothing_and_the_bound_drops_blocks():
    index = index_with(a=5)
    index.forget("a")
    assert index.overlap("a", HASHES) == 0 and index.indexed_blocks("a") is None
    small = KvIndex(max_blocks_per_engine=2)
    entry = small.engine("b")
    for block_hash in HASHES:
        small.store(entry, block_hash)
    assert len(entry.hashes) == 2 and entry.dropped == len(HASHES) - 2


def choose(index: KvIndex, nodes: list[Node], weight: float = 1.0, temperature: float = 0.0, seed: int = 1):
    options = SelectionOptions(
        kv_index=index, kv_overlap_weight=weight, router_temperature=temperature, seed=seed
    )
    selector = make_selector("kv_aware", options)
    request = RouteRequest(model="m", token_ids=TOKENS)
    return selector.choose(nodes, request), request


def test_kv_aware_takes_the_engine_with_the_most_cached_blocks_weighed_against_active_blocks():
    index = index_with(a=1, b=5)  # b holds all 5 reusable blocks (the 6th is never reused)
    a, b, c = Node("a"), Node("b"), Node("c")
    chosen, request = choose(index, [a, b, c])
    assert chosen is b and request.predicted_blocks == {"a": 1, "b": 5, "c": 0}
    # Score = 1 × cached − active: b at 5 − 6 = −1 loses to c at 0 − 0 and a at 1 − 1 = 0 (tie: rotation
    # starts at a).
    b.kv_active_blocks, a.kv_active_blocks = 6, 1
    assert choose(index, [a, b, c])[0] is a
    # With weight 2 the cached blocks win again: b at 10 − 6 = 4.
    assert choose(index, [a, b, c], weight=2.0)[0] is b


def test_kv_aware_never_sends_a_request_past_the_load_bound_however_much_is_cached_there():
    index = index_with(b=5)
    a, b, c = Node("a", in_flight=1), Node("b", in_flight=5), Node("c", in_flight=0)
    # Mean in flight with this request (6 + 1) / 3; factor 2 bounds a node at ceil(14 / 3) = 5 after it
    # takes the request: b (5 + 1) is over, however many blocks it caches, so a and c compete on load.
    chosen, request = choose(index, [a, b, c], weight=100.0)
    assert chosen is c and "b" not in request.predicted_blocks
    b.in_flight = 3  # bound ceil(2 × 5 / 3) = 4, and b at 3 + 1 is within it: its cache wins again
    assert choose(index, [a, b, c], weight=100.0)[0] is b


def test_kv_aware_temperature_samples_and_zero_means_the_best():
    index = index_with(b=5)
    nodes = [Node("a"), Node("b")]
    picks = [choose(index, nodes, temperature=1.0, seed=seed)[0].address for seed in range(200)]
    # Normalised scores 0 (b) and −1 (a): P(a) = e^-1 / (1 + e^-1) ≈ 0.27.
    assert 30 < picks.count("a") < 80 and picks.count("b") > 120
    assert {choose(index, nodes, seed=seed)[0].address for seed in range(20)} == {"b"}


class ScriptedCall:
    """A SubscribeKvEvents call that returns the given batches, then fails like a broken stream."""

    def __init__(self, batches: list[engine_pb2.KvEventBatch]) -> None:
        self._batches = list(batches)
        self.cancelled = False

    async def read(self):
        if self._batches:
            return self._batches.pop(0)
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "gone")

    def cancel(self) -> None:
        self.cancelled = True


def stored(*hashes: bytes) -> list[engine_pb2.KvEvent]:
    return [engine_pb2.KvEvent(stored=engine_pb2.BlockStored(block_hash=h, block_size=BS)) for h in hashes]


def test_the_subscriber_installs_a_complete_snapshot_applies_batches_and_forgets_on_a_gap():
    index = KvIndex(max_blocks_per_engine=100)
    seen: list[int | None] = []
    snapshot = [
        engine_pb2.KvEventBatch(sequence=7, snapshot=True, engine_id="e", events=stored(HASHES[0])),
        engine_pb2.KvEventBatch(
            sequence=7, snapshot=True, snapshot_done=True, engine_id="e", events=stored(HASHES[1])
        ),
    ]
    removed = engine_pb2.KvEvent(removed=engine_pb2.BlockRemoved(block_hashes=[HASHES[0]]))
    live = [
        engine_pb2.KvEventBatch(sequence=8, engine_id="e", events=[*stored(HASHES[2]), removed]),
        engine_pb2.KvEventBatch(sequence=10, engine_id="e", events=stored(HASHES[3])),  # 9 is missing
    ]
    calls = [snapshot + live, snapshot]

    class Recording(ScriptedCall):
        async def read(self):
            seen.append(index.indexed_blocks("x"))
            return await super().read()

    subscriber = KvEventSubscriber(
        "x", lambda: Recording(calls.pop(0) if calls else []), index, backoff_s=0.0, max_backoff_s=0.0
    )

    async def scenario():
        task = asyncio.create_task(subscriber.run())
        for _ in range(30):
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(scenario())
    # Before each read: nothing until the snapshot is complete, then 2 blocks, still 2 after batch 8 (one
    # stored, one removed); batch 10 is a gap, so the second stream starts from nothing until its snapshot.
    assert seen[:7] == [None, None, 2, 2, None, None, 2]
    assert index.peek("x").hashes == set() and index.peek("x").resubscribes >= 1


def test_a_gap_forgets_the_blocks_a_batch_applied_before_it():
    index = KvIndex(max_blocks_per_engine=100)
    seen: list[int | None] = []
    batches = [
        engine_pb2.KvEventBatch(sequence=1, snapshot=True, snapshot_done=True, engine_id="e"),
        engine_pb2.KvEventBatch(sequence=2, engine_id="e", events=stored(*HASHES[:3])),
    ]

    class Recording(ScriptedCall):
        async def read(self):
            seen.append(index.indexed_blocks("x"))
            return await super().read()

    subscriber = KvEventSubscriber("x", lambda: Recording(batches), index, backoff_s=10, max_backoff_s=10)

    async def scenario():
        task = asyncio.create_task(subscriber.run())
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(scenario())
    assert seen == [None, 0, 3]  # before the snapshot, after it, after batch 2
    assert index.indexed_blocks("x") is None  # the stream broke: forgotten until a new snapshot
