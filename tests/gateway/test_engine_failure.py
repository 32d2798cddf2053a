"""A step that fails inside the engine, end to end: the engine ends the live requests with
FINISH_REASON_ERROR, the gateway turns that into a 500 (or an error event mid-stream), no KV block stays
held, and the engine goes on serving. The fault is injected into a real in-process engine server; the
gateway is the real CLI process."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from tests.engine.support.server_thread import ServerThread, engine_config, wait_until
from tests.gateway.sse import post_stream
from tests.support.processes import start_gateway
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration


class FailingSteps:
    """Wraps the executor: the model run number `fail_at` (1-based, counted from arming) raises,
    whether that step runs one forward pass or a decode burst's several."""

    def __init__(self, executor) -> None:
        self._lock = threading.Lock()
        self._countdown: int | None = None
        executor.execute = self._failing(executor.execute)

    def arm(self, fail_at: int) -> None:
        with self._lock:
            self._countdown = fail_at

    def _failing(self, run):
        def maybe_fail(*args):
            with self._lock:
                if self._countdown is not None:
                    self._countdown -= 1
                    if self._countdown == 0:
                        self._countdown = None
                        raise RuntimeError("injected device fault")
            return run(*args)

        return maybe_fail


@pytest.fixture(scope="module")
def engine(stories_path):
    srv = ServerThread(engine_config(stories_path)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def faults(engine):
    return FailingSteps(engine.server.async_engine.core.executor)


@pytest.fixture(scope="module")
def gateway(engine):
    with start_gateway(engine.address) as process:
        yield process


def _blocks_used(engine) -> int:
    return engine.stub().GetLoad(pb.GetLoadRequest()).kv_blocks_used


def test_engine_reports_finish_reason_error_with_a_message(engine, faults):
    faults.arm(3)
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1]),
        sampling=pb.SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, n=2),
    )
    messages = list(engine.stub().Generate(request))
    finals = [m for m in messages if m.finished]
    assert sorted(m.index for m in finals) == [0, 1]
    assert {m.finish_reason for m in finals} == {pb.FINISH_REASON_ERROR}
    assert {m.error for m in finals} == {"the engine step failed: RuntimeError"}
    # Two steps ran before the third failed: the first sampled choice 0, the second both choices.
    assert sum(len(m.token_ids) for m in messages) == 3
    assert wait_until(lambda: _blocks_used(engine) == 0)
    engine.check_integrity()


def test_gateway_answers_500_and_the_engine_keeps_serving(engine, faults, gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    faults.arm(1)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert err.value.status_code == 500
    assert err.value.body["code"] == "engine_error"
    ok = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 8
    assert wait_until(lambda: _blocks_used(engine) == 0)


def test_gateway_stream_ends_with_an_error_event_mid_stream(engine, faults, gateway):
    faults.arm(5)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        response, events = post_stream(http, "/v1/completions", body)
    assert response.status_code == 200
    *chunks, error, done = events
    assert done == "[DONE]"
    assert error["error"]["code"] == "engine_error" and error["error"]["type"] == "server_error"
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    # The tokens of the four model runs before the fifth failed (one each, or a decode burst's
    # several), in up to four chunks (the engine merges tokens the gateway has not read yet): the start
    # of the same completion run to its end, nothing lost or repeated before the error.
    assert 1 <= len(texts) <= 4 and all(texts)
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        whole = http.post("/v1/completions", json={**body, "stream": False}).json()
    streamed = "".join(texts)
    assert whole["choices"][0]["text"].startswith(streamed) and len(streamed) < len(
        whole["choices"][0]["text"]
    )
    assert wait_until(lambda: _blocks_used(engine) == 0)
    engine.check_integrity()
