"""The admin key must not become the engine token or a way to dial arbitrary local targets: POST
/admin/nodes takes HOST:PORT only (no gRPC schemes, control characters or endless hosts), inside
--admin-node-allow, up to --admin-max-nodes; an admin-added node over plain gRPC never receives the engine
token, which statically configured engines do. Fake engines record every call they get (health included)."""

from __future__ import annotations

import os

import openai
import pytest

from tests.routing.helpers import ADMIN_KEY, admin, nodes
from tests.support.fake_engine import FakeEngine
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration

TOKEN = "engine-secret-token"


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "engine-token"
    path.write_text(TOKEN)
    return str(path)


def _wait_serving(url: str, address: str) -> None:
    wait_for(lambda: nodes(url)[address]["state"] == "serving", f"{address} to serve")


def _authorizations(engine: FakeEngine) -> set[str | None]:
    return {metadata.get("authorization") for _, metadata in engine.record.calls}


def test_gateway_targets_other_than_host_port_are_refused_and_never_dialled(
    tmp_path, monkeypatch, token_file
):
    monkeypatch.chdir(tmp_path)  # where a relative unix: path would land
    abstract = f"conduit-admin-test-{os.getpid()}:1"
    listeners = [f"unix:{tmp_path}/engine.sock", "unix:sock:1", f"unix-abstract:{abstract}"]
    with (
        FakeEngine() as static,
        FakeEngine(extra_listeners=listeners) as victim,
        FakeEngine() as sentinel,
        GatewayThread([static.address], admin_keys=(ADMIN_KEY,), engine_auth_token_file=token_file) as gw,
    ):
        attacks = [
            f"unix:{tmp_path}/engine.sock",
            "unix:/tmp/x",
            "unix:sock:1",
            "unix-abstract:x",
            f"unix-abstract:{abstract}",
            f"ipv4:127.0.0.1:{victim.port}",
            f"dns:127.0.0.1:{victim.port}",
            "dns:///x:1",
            f"[::1]:{victim.port}:1",
            "host\n:1",
            f"127.0.0.1:{victim.port}\x00",
            "h" * 5000 + ":1",
            "host",
            "host:0",
            "host:70000",
            "host:+1",
            "[::1]",
            "[127.0.0.1]:1",
            "127.1:1",
        ]
        with admin(gw.url) as client:
            for attack in attacks:
                response = client.post("/nodes", json={"address": attack})
                error = response.json()["error"]
                assert (response.status_code, error["param"], error["code"]) == (400, "address", None), attack
                assert error["message"].startswith("address: expected HOST:PORT: "), attack
                assert len(error["message"]) < 300  # a 5,000-character host is not echoed back
            # A good address added after them is dialled and serves: by then any of them would have been.
            assert client.post("/nodes", json={"address": sentinel.address}).status_code == 201
        _wait_serving(gw.url, sentinel.address)
        assert sorted(nodes(gw.url)) == sorted([static.address, sentinel.address])
    assert victim.record.calls == []


def test_bracketed_ipv6_and_dns_names_are_host_port():
    with (
        FakeEngine() as static,
        GatewayThread([static.address], admin_keys=(ADMIN_KEY,)) as gw,
        admin(gw.url) as client,
    ):
        for address in ("[::1]:50051", "engine-0.engines.ns.svc.cluster.local:50051", "10.0.0.7:65535"):
            added = client.post("/nodes", json={"address": address})
            assert (added.status_code, added.json()["address"]) == (201, address)


def test_allow_list_refuses_other_hosts_before_dialling_them():
    allow = ("10.0.0.0/8", "*.engines.example")
    with (
        FakeEngine() as static,
        FakeEngine() as victim,
        GatewayThread([static.address], admin_keys=(ADMIN_KEY,), admin_node_allow=allow) as gw,
        admin(gw.url) as client,
    ):
        for address in (victim.address, "evil.example:50051", "engines.example.evil:1", "[::1]:50051"):
            refused = client.post("/nodes", json={"address": address})
            error = refused.json()["error"]
            assert (refused.status_code, error["param"], error["code"]) == (
                403,
                "address",
                "node_not_allowed",
            )
            assert "--admin-node-allow" in error["message"]
        for address in ("10.1.2.3:50051", "[::ffff:10.0.0.1]:50051", "e-0.ENGINES.example:50051"):
            assert client.post("/nodes", json={"address": address}).status_code == 201, address
        assert victim.record.calls == []
        assert len(nodes(gw.url)) == 4


def test_admin_nodes_are_bounded():
    with (
        FakeEngine() as static,
        GatewayThread([static.address], admin_keys=(ADMIN_KEY,), admin_max_nodes=2) as gw,
        admin(gw.url) as client,
    ):
        # The static engine does not count: the bound is on what the admin API added.
        assert client.post("/nodes", json={"address": "10.0.0.1:1"}).status_code == 201
        assert client.post("/nodes", json={"address": "10.0.0.2:1"}).status_code == 201
        third = client.post("/nodes", json={"address": "10.0.0.3:1"})
        error = third.json()["error"]
        assert (third.status_code, error["param"], error["code"]) == (409, "address", "too_many_nodes")
        assert "--admin-max-nodes" in error["message"]
        # A duplicate is still a duplicate at the bound.
        assert client.post("/nodes", json={"address": "10.0.0.1:1"}).json()["error"]["code"] == "node_exists"
        assert client.delete("/nodes/10.0.0.1:1").status_code == 200
        assert client.post("/nodes", json={"address": "10.0.0.3:1"}).status_code == 201
        assert len(nodes(gw.url)) == 3


def test_engine_token_goes_to_static_engines_only_over_plain_grpc(token_file):
    with (
        FakeEngine() as static,
        FakeEngine() as added,
        GatewayThread([static.address], admin_keys=(ADMIN_KEY,), engine_auth_token_file=token_file) as gw,
    ):
        with admin(gw.url) as client:
            assert client.post("/nodes", json={"address": added.address}).status_code == 201
        _wait_serving(gw.url, static.address)
        _wait_serving(gw.url, added.address)
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as sdk:
            for _ in range(4):
                sdk.completions.create(model="fake-model", prompt="Once", max_tokens=2)
        # Both engines served requests and their health watch, GetModelInfo and GetLoad.
        assert len(static.record.requests) == len(added.record.requests) == 2
        methods = {method.rsplit("/", 1)[1] for method, _ in added.record.calls}
        assert {"Watch", "GetModelInfo", "Generate"} <= methods
        assert _authorizations(static) == {f"Bearer {TOKEN}"}
        assert _authorizations(added) == {None}


def test_no_plain_grpc_prefill_engine_from_the_admin_api_when_engines_use_a_token(token_file):
    # Its KV handles name the address decode engines pull from, with their own token: refused unseen.
    with (
        FakeEngine() as static,
        FakeEngine() as prefill,
        GatewayThread([static.address], admin_keys=(ADMIN_KEY,), engine_auth_token_file=token_file) as gw,
        admin(gw.url) as client,
    ):
        refused = client.post("/nodes", json={"address": prefill.address, "role": "prefill"})
        error = refused.json()["error"]
        assert (refused.status_code, error["param"], error["code"]) == (409, "role", "node_refused")
        assert "--engine-tls-ca" in error["message"]
        assert sorted(nodes(gw.url)) == [static.address]
    assert prefill.record.calls == []


def test_admin_limits_are_checked_at_start():
    with pytest.raises(ValueError, match="admin_node_allow: 'bad/range' is neither"):
        GatewayThread(["127.0.0.1:1"], admin_keys=(ADMIN_KEY,), admin_node_allow=("bad/range",))
    with pytest.raises(ValueError, match="admin_node_allow: needs admin_key"):
        GatewayThread(["127.0.0.1:1"], admin_node_allow=("10.0.0.0/8",))
    with pytest.raises(ValueError, match="admin_max_nodes: must be >= 0"):
        GatewayThread(["127.0.0.1:1"], admin_keys=(ADMIN_KEY,), admin_max_nodes=-1)
