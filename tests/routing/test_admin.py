"""The admin API over real engines: a node added at run time receives traffic; a drained or removed node
lets its open stream finish and gets no new requests; keys are checked and the API is off by default."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.routing.helpers import ADMIN_KEY, MODEL, admin, complete, deltas, nodes, routed, sdk
from tests.support.polling import wait_for
from tests.support.stories import PROMPT

pytestmark = pytest.mark.integration

# Long enough that the stream is still running when its engine is found and paused, on the CPU kernels
# (thousands of tokens a second on stories260K): prompt + LONG stays within its 512-token context.
LONG = 480


def test_admin_api_needs_its_own_key_and_is_off_unless_configured(fleet, make_gateway):
    gateway = make_gateway(fleet.addresses[:1], api_keys=("api-key",))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer api-key"}):
        for method, path in (
            ("GET", "/admin/nodes"),
            ("POST", "/admin/nodes"),
            ("DELETE", "/admin/nodes/x:1"),
        ):
            response = httpx.request(method, f"{gateway.url}{path}", headers=headers, json={"address": "x:1"})
            assert response.status_code == 401
            error = response.json()["error"]
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error",
                None,
                "invalid_api_key",
            )
    # The admin key is no API key either.
    response = httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 401
    assert [n["address"] for n in nodes(gateway.url).values()] == fleet.addresses[:1]

    off = make_gateway(fleet.addresses[:1], admin_keys=())
    response = httpx.get(f"{off.url}/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_bad_admin_requests_name_the_problem(fleet, make_gateway):
    gateway = make_gateway(fleet.addresses[:1])
    with admin(gateway.url) as client:
        bad = client.post("/nodes", json={"address": "no-port"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "address"
        assert bad.json()["error"]["message"].startswith("address: expected HOST:PORT")
        missing = client.post("/nodes", json={})
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "address")
        extra = client.post("/nodes", json={"address": "h:1", "weight": 2})
        assert (extra.status_code, extra.json()["error"]["param"]) == (400, "weight")
        duplicate = client.post("/nodes", json={"address": fleet.addresses[0]})
        assert (duplicate.status_code, duplicate.json()["error"]["code"]) == (409, "node_exists")
        for method, path in (("DELETE", "/nodes/h:1"), ("POST", "/nodes/h:1/drain"), ("GET", "/nodes/h:1")):
            unknown = client.request(method, path)
            assert unknown.status_code == 404
            assert (unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == (
                "node_not_found",
                "address",
            )


def test_node_added_at_run_time_receives_traffic(fleet, make_gateway):
    gateway = make_gateway(fleet.addresses[:2])
    added = fleet.addresses[2]
    with admin(gateway.url) as client:
        response = client.post("/nodes", json={"address": added})
    assert response.status_code == 201
    assert (response.json()["address"], response.json()["source"]) == (added, "admin")
    wait_for(lambda: nodes(gateway.url)[added]["state"] == "serving", "the new node to serve")
    before = fleet.finished()
    with sdk(gateway.url) as client:
        for i in range(6):
            complete(client, f"Once upon a time {i}")
    assert routed(gateway.url, fleet.addresses) == [2, 2, 2]
    wait_for(lambda: sum(deltas(fleet.finished(), before)) >= 6, "six finished requests")
    assert deltas(fleet.finished(), before) == [2, 2, 2]
    view = nodes(gateway.url)[added]
    assert (view["model"], view["in_flight"], view["failures"], view["ejections"]) == (MODEL, 0, 0, 0)
    wait_for(lambda: nodes(gateway.url)[added]["load"] is not None, "the first GetLoad")
    assert nodes(gateway.url)[added]["load"]["kv_blocks_total"] == fleet.load(2).kv_blocks_total


class LongStream:
    """One streamed completion through the gateway, read in a thread."""

    def __init__(self, url: str) -> None:
        self.tokens: int | None = None
        self.finish_reason: str | None = None
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        with sdk(url) as client:
            stream = client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=LONG,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens

    def join(self) -> tuple[int | None, str | None]:
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()
        return self.tokens, self.finish_reason


def _streaming_node(url: str, fleet) -> tuple[LongStream, str]:
    """A long stream and the node serving it, paused (SIGSTOP) from before the stream was sent, so that
    the stream stays open however fast the engine is (on the CPU kernels it can finish 480 tokens before
    a pause sent after its first token lands); the other engines are paused only while it is found."""
    for index in range(len(fleet.addresses)):
        fleet.pause(index)
    try:
        stream = LongStream(url)
        wait_for(lambda: any(node["in_flight"] == 1 for node in nodes(url).values()), "the stream routed")
        (address,) = [address for address, node in nodes(url).items() if node["in_flight"] == 1]
    except BaseException:
        for index in range(len(fleet.addresses)):
            fleet.resume(index)
        raise
    for index in range(len(fleet.addresses)):
        if index != fleet.index_of(address):
            fleet.resume(index)
    return stream, address


@pytest.mark.parametrize("how", ["drain", "remove"])
def test_drained_or_removed_node_finishes_its_stream_and_gets_no_new_requests(fleet, make_gateway, how):
    gateway = make_gateway(fleet.addresses)
    before = fleet.finished()
    stream, address = _streaming_node(gateway.url, fleet)
    index = fleet.index_of(address)
    try:
        with admin(gateway.url) as client:
            if how == "drain":
                response = client.post(f"/nodes/{address}/drain")
            else:
                response = client.delete(f"/nodes/{address}")
        assert response.status_code == 200
        assert (response.json()["state"], response.json()["in_flight"]) == (
            "draining" if how == "drain" else "removed",
            1,
        )
        with sdk(gateway.url) as client:
            for i in range(4):
                complete(client, f"Meanwhile {i}")
    finally:
        fleet.resume(index)
    assert stream.join() == (LONG, "length")
    wait_for(lambda: sum(deltas(fleet.finished(), before)) >= 5, "five finished requests")
    # The drained engine finished only the stream it already had.
    per_engine = deltas(fleet.finished(), before)
    assert per_engine[index] == 1 and sum(per_engine) == 5
    view = nodes(gateway.url)
    if how == "drain":
        assert (view[address]["state"], view[address]["in_flight"], view[address]["routed"]) == (
            "draining",
            0,
            1,
        )
        with admin(gateway.url) as client:
            assert client.post(f"/nodes/{address}/resume").json()["state"] == "serving"
        with sdk(gateway.url) as client:
            for i in range(3):
                complete(client, f"Back again {i}")
        assert nodes(gateway.url)[address]["routed"] == 2
    else:
        assert address not in view and len(view) == 2
