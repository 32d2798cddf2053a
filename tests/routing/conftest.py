"""Fixtures of the routing tests: three real engines on stories260K shared by the whole package (they take
seconds to start) and in-process gateways in front of them."""

from __future__ import annotations

import pytest

from tests.routing.helpers import ADMIN_KEY, ENGINE_ARGS
from tests.support.engine_fleet import EngineFleet
from tests.support.gateway_thread import GatewayThread
from tests.support.processes import require_shared
from tests.support.stories import MODEL


@pytest.fixture(scope="package")
def fleet():
    model = require_shared(f"models/{MODEL}")
    with EngineFleet(model, 3, ENGINE_ARGS) as engines:
        yield engines


@pytest.fixture
def make_gateway():
    """Start in-process gateways (the real app on real uvicorn) with config overrides; stopped after."""
    started: list[GatewayThread] = []

    def make(engines, **overrides) -> GatewayThread:
        overrides.setdefault("admin_keys", (ADMIN_KEY,))
        gateway = GatewayThread(list(engines), **overrides).start()
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.stop()
