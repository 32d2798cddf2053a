"""The strategies as plain objects (no engines): what each picks for given loads, latencies and keys, and
the registry that makes a strategy one file."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.routing.prefix_key import prefix_key
from conduit_gateway.routing.selection import (
    EngineSelector,
    RoundRobinSelector,
    RouteRequest,
    SelectionOptions,
    make_selector,
    strategy_names,
)
from conduit_gateway.routing.selection.base import unregister_strategy
from conduit_gateway.routing.selection.least_load import LeastLoadSelector
from conduit_gateway.routing.selection.min_expected_latency import MinExpectedLatencySelector
from conduit_gateway.routing.selection.prefix_affinity import HashRing, PrefixAffinitySelector, ring_hash

pytestmark = pytest.mark.unit


@dataclass
class Node:
    address: str
    in_flight: int = 0
    load_score: int = 0
    token_latency_s: float | None = None


def nodes(*loads: int) -> list[Node]:
    return [Node(f"10.0.0.{i}:50051", load_score=load) for i, load in enumerate(loads)]


def test_strategy_names_and_unknown_strategy():
    assert strategy_names() == (
        "kv_aware",
        "least_load",
        "min_expected_latency",
        "prefix_affinity",
        "round_robin",
    )
    with pytest.raises(ValueError, match="^routing: unknown strategy 'random'"):
        make_selector("random")


def test_a_strategy_is_one_class_with_a_name():
    try:

        class LastSelector(EngineSelector):
            name = "last"

            def choose(self, candidates, request=None):
                return candidates[-1]

        assert "last" in strategy_names()
        assert make_selector("last").choose(nodes(0, 0, 0)).address == "10.0.0.2:50051"
    finally:
        unregister_strategy("last")
    assert "last" not in strategy_names()


def test_least_load_never_picks_the_busiest_of_three():
    pool = nodes(0, 5, 1)
    selector = make_selector("least_load", SelectionOptions(seed=7))
    assert isinstance(selector, LeastLoadSelector)
    picks = Counter(selector.choose(pool).address for _ in range(300))
    assert picks["10.0.0.1:50051"] == 0
    # The idlest wins every pair it is in (2 of 3), the middle one the remaining pair.
    assert picks["10.0.0.0:50051"] > picks["10.0.0.2:50051"] > 0
    assert make_selector("least_load").choose(pool[:1]) is pool[0]


def test_min_expected_latency_weighs_queue_by_token_latency():
    fast_busy = Node("a:1", load_score=3, token_latency_s=0.01)  # (3 + 1) * 0.01 = 0.04
    slow_idle = Node("b:1", load_score=0, token_latency_s=0.05)  # 0.05
    unknown = Node("c:1", load_score=1)  # mean latency 0.03 → 0.06
    selector = MinExpectedLatencySelector()
    assert {selector.choose([fast_busy, slow_idle, unknown]).address for _ in range(5)} == {"a:1"}
    # Equal estimates take turns instead of all going to the first.
    twins = [Node("x:1"), Node("y:1"), Node("z:1")]
    fresh = MinExpectedLatencySelector()
    assert [fresh.choose(twins).address for _ in range(6)] == ["x:1", "y:1", "z:1", "x:1", "y:1", "z:1"]


def _key(text: str) -> RouteRequest:
    return RouteRequest(model="m", prefix_key=prefix_key(engine_pb2.GenerateRequest(text=text), 32))


def test_prefix_affinity_is_consistent_and_bounded():
    pool = nodes(0, 0, 0, 0)
    selector = PrefixAffinitySelector(SelectionOptions(affinity_load_factor=1.25))
    request = _key("You are a helpful assistant. Answer briefly. Question one")
    home = selector.choose(pool, request)
    # Only the first 32 characters count: another question with the same opening goes home too.
    assert selector.choose(pool, _key("You are a helpful assistant. Answer briefly. Other")) is home
    ring_order = HashRing(sorted(n.address for n in pool)).walk(ring_hash(request.prefix_key))
    assert home.address == ring_order[0]
    # Loaded past 1.25 × the mean (counting this request), home spills to the next node on the ring.
    home.in_flight = 2
    spill = selector.choose(pool, request)
    assert spill.address == ring_order[1]
    home.in_flight = 1  # (1 + 1) <= ceil(1.25 * 2 / 4) is false, so it still spills
    assert selector.choose(pool, request).address == ring_order[1]
    for node in pool:
        node.in_flight = 1  # evenly loaded: ceil(1.25 * 5 / 4) = 2 admits home again
    assert selector.choose(pool, request) is home


def test_prefix_affinity_moves_only_the_keys_of_a_removed_node():
    addresses = [f"10.0.0.{i}:50051" for i in range(4)]
    keys = [ring_hash(f"prompt {i}".encode()) for i in range(400)]
    before = HashRing(addresses)
    after = HashRing(addresses[:3])
    moved = [k for k in keys if before.walk(k)[0] != after.walk(k)[0]]
    assert moved and all(before.walk(k)[0] == addresses[3] for k in moved)
    # Every node owns some keys.
    assert {before.walk(k)[0] for k in keys} == set(addresses)


def test_prefix_key_by_input_kind():
    text = engine_pb2.GenerateRequest(text="abcdef")
    assert prefix_key(text, 4) == b"t\x00abcd"
    ids = engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=[1, 2, 3, 4, 5]))
    assert prefix_key(ids, 8) == b"i\x00" + (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
    chat = engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(
            messages=[
                engine_pb2.ChatMessage(role="system", content="Be brief."),
                engine_pb2.ChatMessage(role="user", content="Hi"),
            ]
        )
    )
    assert prefix_key(chat, 100) == b"c\x00system\x1fBe brief.\x1euser\x1fHi"
    assert prefix_key(chat, 6) == b"c\x00system"
    assert prefix_key(engine_pb2.GenerateRequest(), 10) == b""


def test_round_robin_cycles_candidates():
    selector = RoundRobinSelector()
    picks = [selector.choose(["a", "b", "c"]) for _ in range(5)]
    assert picks == ["a", "b", "c", "a", "b"]
    assert isinstance(make_selector("round_robin"), RoundRobinSelector)
