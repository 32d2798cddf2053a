"""Fixtures of the disaggregation tests: real engines with roles on stories260K, shared by the serving and
pairing tests of the package (they take seconds to start), and in-process gateways in front of them."""

from __future__ import annotations

import pytest

from tests.disaggregation.helpers import ADMIN_KEY
from tests.support.engine_fleet import EngineFleet
from tests.support.gateway_thread import GatewayThread
from tests.support.processes import require_shared
from tests.support.stories import MODEL

# Indices in `fleet`: two prefill engines, two decode engines, one `both` engine (also the colocated
# reference), and a decode engine whose KV layout differs (32-token blocks).
P1, P2, D1, D2, BOTH, OTHER_LAYOUT = range(6)
ROLES = [
    ("--role", "prefill"),
    ("--role", "prefill"),
    ("--role", "decode"),
    ("--role", "decode"),
    ("--role", "both"),
    ("--role", "decode", "--block-size", "32"),
]


@pytest.fixture(scope="package")
def fleet():
    model = require_shared(f"models/{MODEL}")
    with EngineFleet(model, len(ROLES), ("--max-num-seqs", "8"), per_engine=ROLES) as engines:
        yield engines


class Gateways:
    """Starts in-process gateways (the real app on real uvicorn) over engines of `fleet`, by index (or by
    address): `gateways(prefill=[i...], decode=[j...], engines=[k...], **GatewayConfig overrides)`."""

    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.started: list[GatewayThread] = []

    def __call__(self, prefill=(), decode=(), engines=(), **overrides) -> GatewayThread:
        overrides.setdefault("admin_keys", (ADMIN_KEY,))
        gateway = GatewayThread(
            self._addresses(engines),
            prefill_engines=tuple(self._addresses(prefill)),
            decode_engines=tuple(self._addresses(decode)),
            **overrides,
        ).start()
        self.started.append(gateway)
        return gateway

    def _addresses(self, engines) -> list[str]:
        """Fleet indices become addresses; addresses (e.g. a fake engine's) stay as they are."""
        return [self.fleet.addresses[e] if isinstance(e, int) else e for e in engines]

    def stop_all(self) -> None:
        for gateway in self.started:
            gateway.stop()


@pytest.fixture
def make_gateway(fleet):
    """Gateways stopped after the test."""
    gateways = Gateways(fleet)
    yield gateways
    gateways.stop_all()


@pytest.fixture(scope="module")
def make_module_gateway(fleet):
    """Gateways stopped after the module."""
    gateways = Gateways(fleet)
    yield gateways
    gateways.stop_all()
