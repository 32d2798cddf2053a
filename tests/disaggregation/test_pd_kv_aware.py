"""kv_aware with disaggregation: the prefill and the decode pool are both scored on the KV index, so a
session's next turn goes back to the prefill engine that caches its prompt and to the decode engine that
already holds its KV (which then pulls only the new blocks)."""

from __future__ import annotations

import uuid

import pytest

from tests.disaggregation.conftest import D1, D2, P1, P2
from tests.disaggregation.helpers import admin, load, sdk, wait_idle
from tests.support.polling import wait_for
from tests.support.stories import KNOWN_STORY, MODEL

pytestmark = pytest.mark.integration


def _routed(url: str) -> dict[str, int]:
    with admin(url) as client:
        return {node["address"]: node["routed"] for node in client.get("/nodes").json()["nodes"]}


def _indexed(url: str) -> dict[str, int | None]:
    with admin(url) as client:
        return {node["address"]: node["kv_indexed_blocks"] for node in client.get("/nodes").json()["nodes"]}


def test_both_pools_send_the_next_turn_where_its_kv_is(fleet, make_gateway):
    gateway = make_gateway(prefill=[P1, P2], decode=[D1, D2], routing="kv_aware")
    wait_for(lambda: None not in _indexed(gateway.url).values(), "every engine's snapshot")
    opening = f"{uuid.uuid4().hex} {KNOWN_STORY} {KNOWN_STORY}"
    turns = [opening, f"{opening} Then the next day came."]
    chosen = []
    saved = []
    with sdk(gateway.url) as client:
        for prompt in turns:
            wait_idle(fleet)
            before = _routed(gateway.url)
            saved_before = {d: load(fleet.addresses[d]).kv_bytes_saved for d in (D1, D2)}
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
            after = _routed(gateway.url)
            chosen.append({address for address in after if after[address] != before.get(address)})
            saved.append({d: load(fleet.addresses[d]).kv_bytes_saved - saved_before[d] for d in (D1, D2)})
            # The engines' events reach the index: the decode engine's cache holds the pulled prompt too.
            wait_for(
                lambda: all(
                    _indexed(gateway.url)[fleet.addresses[i]] == load(fleet.addresses[i]).kv_blocks_cached
                    for i in (P1, P2, D1, D2)
                ),
                "the index to match the engines",
            )
    assert len(chosen[0]) == 2 and chosen[1] == chosen[0]  # one prefill and one decode engine, both times
    decode = next(d for d in (D1, D2) if fleet.addresses[d] in chosen[0])
    assert saved[0][decode] == 0 and saved[1][decode] > 0  # the second pull skipped the blocks it held
