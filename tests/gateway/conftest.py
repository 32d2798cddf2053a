"""Fixtures of the gateway tests: a scriptable fake engine and in-process gateways in front of it, and
the real stack (engine and gateway subprocesses on stories260K) for the modules that drive it."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.gateway_thread import GatewayThread
from tests.support.processes import require_shared, start_engine, start_gateway
from tests.support.stories import MODEL as STORIES

MODEL = "fake-model"


@pytest.fixture(scope="module")
def fake_engine_server():
    with FakeEngine(MODEL) as fake:
        yield fake


@pytest.fixture
def fake(fake_engine_server):
    """The module's fake engine with a fresh default script and record."""
    fake_engine_server.reset()
    yield fake_engine_server
    fake_engine_server.release()  # never leave a held stream behind


@pytest.fixture(scope="module")
def gateway(fake_engine_server):
    with GatewayThread([fake_engine_server.address]) as gw:
        yield gw


@pytest.fixture
def client(gateway, fake):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def http(gateway, fake):
    with httpx.Client(base_url=gateway.url, timeout=30) as raw:
        yield raw


@pytest.fixture(scope="module")
def parsing_gateway(fake_engine_server):
    """A gateway with --tool-call-parser hermes and --reasoning-parser qwen3."""
    with GatewayThread(
        [fake_engine_server.address], tool_call_parser="hermes", reasoning_parser="qwen3"
    ) as gw:
        yield gw


@pytest.fixture
def parsing_http(parsing_gateway, fake):
    with httpx.Client(base_url=parsing_gateway.url, timeout=30) as raw:
        yield raw


@pytest.fixture
def make_gateway():
    """Start extra gateways with config overrides; all are stopped after the test."""
    started: list[GatewayThread] = []

    def make(engines, **overrides) -> GatewayThread:
        gw = GatewayThread(list(engines), **overrides).start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


@pytest.fixture(scope="module")
def stories_engine(request):
    """The real engine on stories260K (a subprocess); a module passes flags with ENGINE_ARGS."""
    args = getattr(request.module, "ENGINE_ARGS", ())
    with start_engine(require_shared(f"models/{STORIES}"), *args) as process:
        yield process


@pytest.fixture(scope="module")
def stories_gateway(stories_engine):
    """The real gateway (a subprocess, no parsers) in front of `stories_engine`."""
    with start_gateway(stories_engine.address) as process:
        yield process


@pytest.fixture(scope="module")
def stories_sdk(stories_gateway):
    with openai.OpenAI(base_url=f"{stories_gateway.url}/v1", api_key="unused", max_retries=0) as client:
        yield client
