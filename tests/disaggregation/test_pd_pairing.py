"""The gateway pairs only engines that can exchange KV blocks: a prefill or decode engine joins its pool only
when its engine role covers the pool and its KV layout equals the other disaggregated engines' of its model.

At start (the real `conduit-gateway` process) a static engine refused that way stops the gateway with the
reason; on the admin API such an engine is not added (409 `node_refused`); one that joins later (its
engine was not up when the gateway started) stays out of rotation with the reason in its node view.
"""

from __future__ import annotations

import sys

import pytest

from tests.disaggregation.conftest import BOTH, D1, D2, OTHER_LAYOUT, P1
from tests.disaggregation.helpers import admin, sdk, wait_idle
from tests.support.health import engine_serving
from tests.support.polling import wait_for
from tests.support.processes import (
    ENGINE_START_TIMEOUT_S,
    ManagedProcess,
    ProcessStartError,
    free_port,
    require_shared,
    start_gateway,
)
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration


def nodes(url: str) -> dict[str, dict]:
    with admin(url) as client:
        return {node["address"]: node for node in client.get("/nodes").json()["nodes"]}


def test_engines_of_different_kv_layouts_stop_the_gateway_at_start(fleet):
    prefill, decode = fleet.addresses[P1], fleet.addresses[OTHER_LAYOUT]
    with pytest.raises(ProcessStartError) as failed:
        start_gateway("", "--prefill-engine", prefill, "--decode-engine", decode)
    output = str(failed.value)
    assert "gateway exited with code 3" in output
    # Whichever engine answered second is the one refused, naming the other.
    assert (
        f"decode_engine: {decode} refused: its KV layout (fingerprint" in output
        and f"differs from prefill engine {prefill}'s" in output
    ) or (
        f"prefill_engine: {prefill} refused: its KV layout (fingerprint" in output
        and f"differs from decode engine {decode}'s" in output
    )
    assert "block size 32" in output and "block size 16" in output
    assert "engines whose KV layouts differ cannot exchange KV blocks" in output


def test_an_engine_of_the_wrong_role_stops_the_gateway_at_start(fleet):
    flags = ("--prefill-engine", fleet.addresses[D1], "--decode-engine", fleet.addresses[D2])
    with pytest.raises(ProcessStartError) as failed:
        start_gateway("", *flags)
    assert (
        f"prefill_engine: {fleet.addresses[D1]} refused: its engine's role is decode; a prefill node needs "
        "an engine started with --role prefill or --role both"
    ) in str(failed.value)


def test_the_admin_api_refuses_an_engine_of_another_layout_and_adds_a_matching_one(fleet, make_gateway):
    gateway = make_gateway(prefill=[P1], decode=[D1])
    with admin(gateway.url) as client:
        refused = client.post("/nodes", json={"address": fleet.addresses[OTHER_LAYOUT], "role": "decode"})
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("node_refused", "address")
        assert error["message"].startswith(
            f"The decode engine {fleet.addresses[OTHER_LAYOUT]} was not added: "
        )
        assert "cannot exchange KV blocks" in error["message"]
        assert fleet.addresses[OTHER_LAYOUT] not in nodes(gateway.url)
        wrong_role = client.post("/nodes", json={"address": fleet.addresses[D2], "role": "prefill"})
        assert wrong_role.status_code == 409 and "its engine's role is decode" in wrong_role.text
        added = client.post("/nodes", json={"address": fleet.addresses[D2], "role": "decode"})
        assert added.status_code == 201, added.text
        assert (added.json()["role"], added.json()["source"]) == ("decode", "admin")
        both = client.post("/nodes", json={"address": fleet.addresses[BOTH], "role": "prefill"})
        assert both.status_code == 201 and both.json()["role"] == "prefill"
        bad_role = client.post("/nodes", json={"address": "127.0.0.1:1", "role": "middle"})
        assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "role"
    wait_for(lambda: nodes(gateway.url)[fleet.addresses[D2]]["state"] == "serving", "the added node")
    with sdk(gateway.url) as client:
        for _ in range(4):  # round robin over both decode engines, two prefill engines
            result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == ", there was a little girl"
    wait_idle(fleet, [P1, D1, D2, BOTH])


def test_an_engine_that_joins_later_with_another_layout_stays_out_with_the_reason(fleet, make_gateway):
    port = free_port()
    late = f"127.0.0.1:{port}"
    gateway = make_gateway(prefill=[P1], decode=[D1])
    with admin(gateway.url) as client:
        assert client.post("/nodes", json={"address": late, "role": "decode"}).status_code == 201
    assert nodes(gateway.url)[late]["state"] == "unavailable"  # nothing listens there yet
    model = require_shared(f"models/{MODEL}")
    args = [
        sys.executable,
        "-m",
        "conduit_engine.entrypoints.cli",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
    ]
    args += ["--port", str(port), "--role", "decode", "--block-size", "32"]
    with ManagedProcess("engine", args, port) as engine:
        engine.wait_ready(lambda: engine_serving(late), ENGINE_START_TIMEOUT_S)
        wait_for(lambda: nodes(gateway.url)[late]["state"] == "refused", "the late engine's refusal", 1200)
    view = nodes(gateway.url)[late]
    assert view["serving"] is False and "cannot exchange KV blocks" in view["refusal"]
