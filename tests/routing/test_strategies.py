"""The strategies over three real engines: round robin spreads evenly, prefix affinity keeps a shared
prefix on one engine (whose prefix cache then serves it), least_load steers around a busy engine."""

from __future__ import annotations

import threading
import uuid

import grpc
import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.routing.prefix_key import prefix_key
from conduit_gateway.routing.selection.prefix_affinity import HashRing, ring_hash
from tests.routing.helpers import MODEL, complete, deltas, nodes, routed, sdk
from tests.support.polling import wait_for
from tests.support.stories import KNOWN_STORY

pytestmark = pytest.mark.integration

STORY = f"{KNOWN_STORY} "


def finished_after(fleet, before: list[int], total: int) -> list[int]:
    """Per-engine completed requests since `before`, once `total` of them have been counted."""
    wait_for(lambda: sum(deltas(fleet.finished(), before)) >= total, f"{total} finished requests")
    return deltas(fleet.finished(), before)


def test_round_robin_spreads_requests_evenly(fleet, make_gateway):
    gateway = make_gateway(fleet.addresses, routing="round_robin")
    before = fleet.finished()
    with sdk(gateway.url) as client:
        texts = [complete(client, f"{STORY} {i}").choices[0].text for i in range(9)]
    assert all(texts)
    assert finished_after(fleet, before, 9) == [3, 3, 3]
    assert routed(gateway.url, fleet.addresses) == [3, 3, 3]


def home_node(addresses: list[str], prompt: str, chars: int) -> str:
    """Where consistent hashing puts `prompt` when no engine is loaded: the first node on the ring."""
    key = prefix_key(engine_pb2.GenerateRequest(text=prompt), chars)
    return HashRing(sorted(addresses)).walk(ring_hash(key))[0]


def test_prefix_affinity_keeps_a_shared_prefix_on_one_engine_and_its_cache(fleet, make_gateway):
    chars = 256
    gateway = make_gateway(fleet.addresses, routing="prefix_affinity", affinity_prefix_chars=chars)
    # Fresh prefixes (never cached anywhere) until two of them have different home engines.
    groups: dict[str, str] = {}
    while len(groups) < 2:
        prefix = f"{uuid.uuid4().hex} {STORY * 3}"
        groups.setdefault(home_node(fleet.addresses, prefix, chars), prefix)
    block_size = 16
    with sdk(gateway.url) as client:
        for home, prefix in groups.items():
            before = fleet.finished()
            prompts = [f"{prefix}Then {name} came to play." for name in ("Tom", "Sue", "Max", "Ben")]
            usages = [complete(client, prompt).usage for prompt in prompts]
            per_engine = finished_after(fleet, before, len(prompts))
            assert per_engine == [4 if address == home else 0 for address in fleet.addresses]
            # The first request computed the prefix; each later one found its full blocks cached.
            shared = _common_length(fleet.token_ids(prompts[0]), fleet.token_ids(prompts[1]))
            assert shared > 4 * block_size
            cached = [usage.prompt_tokens_details.cached_tokens for usage in usages]
            assert cached == [0] + [shared // block_size * block_size] * 3


def _common_length(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def test_least_load_sends_no_new_requests_to_a_busy_engine(fleet, make_gateway):
    gateway = make_gateway(fleet.addresses, routing="least_load", load_interval_s=0.2)
    busy = fleet.addresses[0]
    # Sixteen long generations straight to engine 0: two run, fourteen wait (it batches two sequences);
    # on the CPU kernels one pair of 480 tokens takes a fraction of a second, so eight pairs keep it
    # visibly busy through the gateway's load polls and the eight requests below.
    calls = [
        fleet.stub(0).Generate(
            engine_pb2.GenerateRequest(
                text="Once",
                sampling=engine_pb2.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True),
            ),
            timeout=300,
        )
        for _ in range(16)
    ]
    readers = [threading.Thread(target=_drain, args=(call,), daemon=True) for call in calls]
    for reader in readers:
        reader.start()
    try:
        wait_for(lambda: (nodes(gateway.url)[busy]["load"] or {}).get("waiting", 0) >= 3, "the busy load")
        before = routed(gateway.url, fleet.addresses)
        with sdk(gateway.url) as client:
            for i in range(8):
                assert complete(client, f"{STORY} {i}").model == MODEL
        sent = deltas(routed(gateway.url, fleet.addresses), before)
        assert sent[0] == 0 and sum(sent) == 8
    finally:
        for call in calls:
            call.cancel()
        for reader in readers:
            reader.join(timeout=30)
        # Leave the engine idle for the next test (its counts then only move with that test's requests).
        wait_for(lambda: _idle(fleet.load(0)), "engine 0 to drop the cancelled generations")


def _idle(load: engine_pb2.GetLoadResponse) -> bool:
    return load.running_requests == 0 and load.waiting_requests == 0


def _drain(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass  # cancelled by the test
