"""DNS discovery with a resolver the test controls: the records it returns are the pool's DNS nodes, a
failed lookup keeps them, a name without records empties them. Also the real resolver on `localhost`."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from conduit_gateway.routing.discovery import DnsDiscovery
from tests.routing.helpers import admin, complete, deltas, nodes, routed, sdk
from tests.support.health import gateway_health
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration

NAME = "engines.conduit.test"


class StubResolver:
    """Answers every lookup of NAME with `records` (host, port), or raises `error`; counts lookups."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int]] = []
        self.error: OSError | None = None
        self.lookups = 0
        self._lock = threading.Lock()

    async def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        assert (host, port) == (NAME, 50051)
        with self._lock:
            self.lookups += 1
            if self.error is not None:
                raise self.error
            return list(self.records)

    def set(self, records: list[tuple[str, int]] | None = None, error: OSError | None = None) -> int:
        """Change the answer; returns the lookup count at the change."""
        with self._lock:
            self.records = records or []
            self.error = error
            return self.lookups

    def wait_lookups(self, after: int, more: int = 2) -> None:
        """Wait until `more` lookups happened since `after` (so the pool has seen the new answer)."""
        wait_for(lambda: self.lookups >= after + more, "DNS lookups")


def _record(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_dns_records_are_the_pool(fleet, make_gateway):
    resolver = StubResolver()
    resolver.set([_record(fleet.addresses[0])])
    gateway = make_gateway([], engine_dns=f"{NAME}:50051", dns_interval_s=0.1, resolver=resolver)
    assert [(n["address"], n["source"]) for n in nodes(gateway.url).values()] == [(fleet.addresses[0], "dns")]

    # A second record: a second node, and traffic reaches it.
    resolver.wait_lookups(resolver.set([_record(a) for a in fleet.addresses[:2]]))
    assert list(nodes(gateway.url)) == fleet.addresses[:2]
    wait_for(lambda: all(n["state"] == "serving" for n in nodes(gateway.url).values()), "both serving")
    with sdk(gateway.url) as client:
        for i in range(4):
            complete(client, f"Once upon a time {i}")
    assert routed(gateway.url, fleet.addresses) == [2, 2, 0]

    # A failed lookup keeps the known engines.
    resolver.wait_lookups(resolver.set(error=OSError("DNS server unreachable")))
    assert list(nodes(gateway.url)) == fleet.addresses[:2]

    # The first record goes away (its pod was deleted): so does its node, and its traffic.
    resolver.wait_lookups(resolver.set([_record(fleet.addresses[1])]))
    assert list(nodes(gateway.url)) == [fleet.addresses[1]]
    before = fleet.finished()
    with sdk(gateway.url) as client:
        for i in range(3):
            complete(client, f"Later {i}")
    wait_for(lambda: sum(deltas(fleet.finished(), before)) >= 3, "three finished requests")
    assert deltas(fleet.finished(), before) == [0, 3, 0]

    # No records at all (the Service has no ready pods): an empty pool answers 503.
    resolver.wait_lookups(resolver.set(error=socket.gaierror(socket.EAI_NONAME, "Name or service not known")))
    assert nodes(gateway.url) == {}
    assert gateway_health(gateway.url) == 503


def test_static_and_admin_nodes_are_not_touched_by_dns(fleet, make_gateway):
    resolver = StubResolver()
    resolver.set([_record(fleet.addresses[0]), _record(fleet.addresses[1])])
    gateway = make_gateway(
        fleet.addresses[:1], engine_dns=f"{NAME}:50051", dns_interval_s=0.1, resolver=resolver
    )
    view = nodes(gateway.url)
    # The static node is found by DNS too: it stays one node, still static.
    assert [(a, n["source"]) for a, n in view.items()] == [
        (fleet.addresses[0], "static"),
        (fleet.addresses[1], "dns"),
    ]
    with admin(gateway.url) as client:
        assert client.post("/nodes", json={"address": fleet.addresses[2]}).status_code == 201
    resolver.wait_lookups(resolver.set([]))
    assert [(a, n["source"]) for a, n in nodes(gateway.url).items()] == [
        (fleet.addresses[0], "static"),
        (fleet.addresses[2], "admin"),
    ]


def test_default_resolver_returns_the_a_records_of_a_name():
    found: list[set[str]] = []

    async def resolve() -> set[str] | None:
        return await DnsDiscovery("localhost:50051", 10.0, found.append).resolve_now()

    assert asyncio.run(resolve()) == {"127.0.0.1:50051"}
    assert found == [{"127.0.0.1:50051"}]
