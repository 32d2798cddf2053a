"""The generation endpoints answered without FastAPI's router (http/direct_routes.py) answer every
request as FastAPI's route would: the same gateway app built with and without them, on the same fake
engine, gets the same status and body for bodies a client can get wrong in every way FastAPI tells
apart (no body, no or another Content-Type, broken JSON, JSON that is not an object, bad fields), and
for good ones."""

from __future__ import annotations

import json

import httpx
import pytest

from conduit_gateway.http import app as app_module
from conduit_gateway.http.direct_routes import DirectRoutes
from tests.gateway.conftest import MODEL
from tests.support.gateway_thread import GatewayThread

pytestmark = pytest.mark.integration

JSON = {"content-type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

CASES = [
    ("/v1/chat/completions", b"", JSON),
    ("/v1/chat/completions", b"", {}),
    ("/v1/chat/completions", json.dumps(CHAT).encode(), {}),  # no Content-Type: not read as JSON
    ("/v1/chat/completions", json.dumps(CHAT).encode(), {"content-type": "text/plain"}),
    ("/v1/chat/completions", json.dumps(CHAT).encode(), {"content-type": "application/vnd.api+json"}),
    ("/v1/chat/completions", json.dumps(CHAT).encode(), {"content-type": "application/json; charset=utf-8"}),
    ("/v1/chat/completions", b'{"model": ', JSON),
    ("/v1/chat/completions", b"[1, 2]", JSON),
    ("/v1/chat/completions", b'"text"', JSON),
    ("/v1/chat/completions", json.dumps({**CHAT, "temperature": "hot"}).encode(), JSON),
    ("/v1/chat/completions", json.dumps({**CHAT, "unknown": 1}).encode(), JSON),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": []}).encode(), JSON),
    ("/v1/chat/completions", json.dumps({**CHAT, "model": "nope"}).encode(), JSON),
    ("/v1/completions", json.dumps(COMPLETION).encode(), JSON),
    ("/v1/completions", json.dumps({**COMPLETION, "prompt": "x" * 100_000}).encode(), JSON),
    ("/v1/completions", json.dumps({**COMPLETION, "n": 0}).encode(), JSON),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 2}).encode(), JSON),
    ("/v1/messages", b"{", JSON),
    ("/v1/responses", json.dumps({"model": MODEL, "input": 5}).encode(), JSON),
]


@pytest.fixture(scope="module")
def both(fake_engine_server):
    with GatewayThread([fake_engine_server.address]) as direct:
        original = app_module.GENERATION_PATHS
        app_module.GENERATION_PATHS = frozenset()  # the app as it was: every route through FastAPI
        try:
            routed = GatewayThread([fake_engine_server.address])
        finally:
            app_module.GENERATION_PATHS = original
        # What the comparison stands on: only the first app answers the four endpoints itself.
        assert direct_paths(direct) == {
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/messages",
            "/v1/responses",
        }
        assert direct_paths(routed) == set()
        with routed:
            yield direct, routed


def direct_paths(gateway: GatewayThread) -> set[str]:
    (layer,) = [layer for layer in gateway.app.user_middleware if layer.cls is DirectRoutes]
    return {route.path for route in layer.kwargs["routes"]}


def answer(url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, object]:
    response = httpx.post(url + path, content=body, headers=headers, timeout=30)
    if response.headers.get("content-type", "").startswith("application/json"):
        payload = response.json()
        if isinstance(payload, dict):  # ids and timestamps differ between any two answers
            for key in ("id", "created", "request_id"):
                payload.pop(key, None)
        return response.status_code, payload
    return response.status_code, response.headers.get("content-type")


@pytest.mark.parametrize(("path", "body", "headers"), CASES)
def test_the_direct_route_answers_as_fastapis_route(both, fake, path, body, headers):
    direct, routed = both
    assert answer(direct.url, path, body, headers) == answer(routed.url, path, body, headers)


def test_another_method_still_gets_fastapis_405(both, fake):
    direct, _ = both
    response = httpx.get(direct.url + "/v1/chat/completions", timeout=30)
    assert response.status_code == 405
    assert response.json()["error"]["message"] == "Method GET is not allowed on /v1/chat/completions"
