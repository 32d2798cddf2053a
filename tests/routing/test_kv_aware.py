"""kv_aware over three real engines: the gateway's KV index mirrors what each engine really caches (from
their SubscribeKvEvents streams), a session's next turn goes where its blocks are, and an engine that
restarts drops out of the index so the next turn of a session that lived there is routed by load."""

from __future__ import annotations

import threading
import uuid

import grpc
import httpx
import pytest

from conduit.engine.v1 import engine_pb2
from tests.routing.helpers import complete, deltas, nodes, routed, sdk
from tests.support.polling import wait_for
from tests.support.stories import KNOWN_STORY, MODEL

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16


def _index_matches_engines(gateway, fleet) -> bool:
    """Every engine idle and the index holds exactly the blocks its prefix cache holds."""
    view = nodes(gateway.url)
    for index, address in enumerate(fleet.addresses):
        load = fleet.load(index)
        if load.running_requests or load.waiting_requests:
            return False
        if view[address]["kv_indexed_blocks"] != load.kv_blocks_cached:
            return False
    return True


def _prediction_blocks(gateway, address: str) -> dict[str, float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    kinds: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("conduit_gateway_kv_prediction_blocks_total{") and f'engine="{address}"' in line:
            kind = line.split('kind="')[1].split('"')[0]
            kinds[kind] = float(line.rsplit(" ", 1)[1])
    return kinds


def _session(turns: int) -> list[str]:
    """The prompts of one conversation: each turn is the previous one plus a new line."""
    opening = f"{uuid.uuid4().hex} {KNOWN_STORY} {KNOWN_STORY}"
    return [opening + "".join(f" Then turn {i} came." for i in range(1, turn + 1)) for turn in range(turns)]


def test_the_index_mirrors_the_engines_and_a_session_stays_on_its_cache(fleet, make_gateway):
    gateway = make_gateway(fleet.addresses, routing="kv_aware", load_interval_s=0.2)
    wait_for(lambda: _index_matches_engines(gateway, fleet), "the index to match the engines' caches")
    prompts = _session(3)
    before = routed(gateway.url, fleet.addresses)
    with sdk(gateway.url) as client:
        first = complete(client, prompts[0])
        home = fleet.addresses[deltas(routed(gateway.url, fleet.addresses), before).index(1)]
        wait_for(lambda: _index_matches_engines(gateway, fleet), "the first turn's blocks in the index")
        usages = [first.usage]
        for prompt in prompts[1:]:
            usages.append(complete(client, prompt).usage)
            wait_for(lambda: _index_matches_engines(gateway, fleet), "the turn's blocks in the index")
    sent = deltas(routed(gateway.url, fleet.addresses), before)
    assert sent == [3 if address == home else 0 for address in fleet.addresses]
    # Each later turn found the previous turn's prompt blocks cached, exactly as predicted.
    for turn in (1, 2):
        previous, current = fleet.token_ids(prompts[turn - 1]), fleet.token_ids(prompts[turn])
        shared = next(
            (i for i, (a, b) in enumerate(zip(previous, current, strict=False)) if a != b), len(previous)
        )
        # The previous turn also cached the blocks its 2 generated tokens completed: at least these.
        assert usages[turn].prompt_tokens_details.cached_tokens >= shared // BLOCK_SIZE * BLOCK_SIZE > 0
    kinds = _prediction_blocks(gateway, home)
    assert kinds["predicted"] == kinds["actual"] == kinds["agreed"] == kinds["union"] > 0


def _drain(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass  # cancelled by the test


def test_after_a_restart_the_index_forgets_the_engine_and_its_session_is_routed_by_load(fleet, make_gateway):
    # An overlap weight this large makes any cached block outweigh any load: a stale index entry would
    # send the session back to its old engine however busy that is.
    gateway = make_gateway(fleet.addresses, routing="kv_aware", load_interval_s=0.2, kv_overlap_weight=1e6)
    wait_for(lambda: _index_matches_engines(gateway, fleet), "the index to match the engines' caches")
    prompts = _session(2)
    before = routed(gateway.url, fleet.addresses)
    with sdk(gateway.url) as client:
        complete(client, prompts[0])
    victim = deltas(routed(gateway.url, fleet.addresses), before).index(1)
    home = fleet.addresses[victim]
    wait_for(lambda: _index_matches_engines(gateway, fleet), "the session's blocks in the index")
    assert nodes(gateway.url)[home]["kv_indexed_blocks"] >= len(fleet.token_ids(prompts[0])) // BLOCK_SIZE

    fleet.kill(victim)
    fleet.restart(victim)
    # Back in rotation with the new engine's snapshot: it caches nothing, and the index says so.
    wait_for(
        lambda: nodes(gateway.url)[home]["serving"] and nodes(gateway.url)[home]["kv_indexed_blocks"] == 0,
        "the restarted engine's empty snapshot",
    )
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    resubscribes = [line for line in text.splitlines() if "kv_event_resubscribes" in line and home in line]
    # Once at least (again while the new process loads the model and answers UNAVAILABLE).
    assert len(resubscribes) == 1 and float(resubscribes[0].rsplit(" ", 1)[1]) >= 1
    # Make the restarted engine the busiest (straight over gRPC, not through the gateway).
    calls = [
        fleet.stub(victim).Generate(
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
        wait_for(
            lambda: (nodes(gateway.url)[home]["load"] or {}).get("kv_blocks_used", 0) > 0, "the busy load"
        )
        before = routed(gateway.url, fleet.addresses)
        with sdk(gateway.url) as client:
            usage = complete(client, prompts[1]).usage
        sent = deltas(routed(gateway.url, fleet.addresses), before)
        assert sent[victim] == 0 and sum(sent) == 1
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert _prediction_blocks(gateway, home)["predicted"] == 0  # never scored as holding anything
    finally:
        for call in calls:
            call.cancel()
        for reader in readers:
            reader.join(timeout=30)
        wait_for(lambda: fleet.load(victim).running_requests == 0, "the restarted engine to go idle")


def test_a_text_prompt_routed_by_its_token_ids_gets_the_engines_own_answer(fleet, make_gateway):
    # kv_aware sends a text prompt as the ids the engine's Tokenize gave (no second tokenization): the
    # completion and usage are exactly those of the text sent straight to an engine.
    gateway = make_gateway(fleet.addresses, routing="kv_aware", load_interval_s=0.2)
    wait_for(lambda: _index_matches_engines(gateway, fleet), "the index to match the engines' caches")
    prompt = f"{uuid.uuid4().hex} {KNOWN_STORY}"
    direct = list(
        fleet.stub(0).Generate(
            engine_pb2.GenerateRequest(
                text=prompt, sampling=engine_pb2.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            ),
            timeout=60,
        )
    )
    with sdk(gateway.url) as client:
        routed_answer = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
    assert routed_answer.choices[0].text == "".join(m.text for m in direct)
    assert routed_answer.usage.prompt_tokens == len(fleet.token_ids(prompt))
