"""End to end through the real Envoy: engine (stories260K) + gateway + Envoy as processes on 127.0.0.1.

Envoy runs deploy/envoy/envoy.yaml with only its addresses rewritten for loopback. The tests run in file
order on one stack; the last one stops the engine and watches Envoy eject it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.deploy import dockerfiles
from tests.deploy.envoy_process import stack_behind_envoy
from tests.deploy.paths import ENGINE_DOCKERFILE, GATEWAY_DOCKERFILE
from tests.support.processes import free_port, require_shared, start_engine, start_gateway
from tests.support.stories import MODEL, PROMPT, PROMPT_IDS

pytestmark = pytest.mark.deploy

# Far more tokens than one SSE event: the first chunk must reach the client while the rest is still coming.
STREAM_TOKENS = 400


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = require_shared(f"models/{MODEL}")
    with stack_behind_envoy(
        tmp_path_factory.mktemp("envoy"),
        lambda: start_engine(model, "--max-num-seqs", "4"),
        lambda engine: start_gateway(engine.address),
    ) as processes:
        yield processes


@pytest.fixture(scope="module")
def engine_stub(stack):
    engine, _, _ = stack
    with grpc.insecure_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def _client(envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{envoy.http_port}/v1", api_key="unused", max_retries=0)


def test_envoy_sees_both_upstreams_healthy(stack):
    engine, gateway, envoy = stack
    assert envoy.health_flags("engine") == {engine.address: "healthy"}
    assert envoy.health_flags("gateway") == {gateway.address: "healthy"}


def test_sse_stream_through_envoy_delivers_the_first_chunk_before_generation_ends(stack, engine_stub):
    _, _, envoy = stack
    before = engine_stub.GetLoad(engine_pb2.GetLoadRequest())
    assert before.running_requests == 0
    stream = _client(envoy).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=STREAM_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices and first.choices[0].finish_reason is None
    # The sequence of events is the proof: with the first chunk in hand, the engine still has the request
    # running and has generated fewer tokens than were asked for.
    during = engine_stub.GetLoad(engine_pb2.GetLoadRequest())
    assert during.running_requests == 1
    assert during.generated_tokens - before.generated_tokens < STREAM_TOKENS
    rest = list(chunks)
    finishes = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert rest[-1].usage.completion_tokens == STREAM_TOKENS
    after = engine_stub.GetLoad(engine_pb2.GetLoadRequest())
    assert after.running_requests == 0
    assert after.generated_tokens - before.generated_tokens == STREAM_TOKENS


def test_grpc_generate_through_envoy_streams_the_engines_tokens(stack, engine_stub):
    _, _, envoy = stack
    request = engine_pb2.GenerateRequest(
        text=PROMPT, sampling=engine_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    direct = list(engine_stub.Generate(request))
    with grpc.insecure_channel(f"127.0.0.1:{envoy.grpc_port}") as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate(request)
        proxied = list(call)
        headers = dict(call.initial_metadata())
    # Envoy's router stamps the upstream's response headers: this stream did go through the proxy.
    assert "x-envoy-upstream-service-time" in headers
    assert len(proxied) > 1
    assert [t for m in proxied for t in m.token_ids] == [t for m in direct for t in m.token_ids]
    assert len([t for m in proxied for t in m.token_ids]) == 12
    assert proxied[-1].finished and proxied[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert proxied[0].prompt_token_ids == list(PROMPT_IDS)


def test_messages_api_streams_through_envoy(stack):
    """Anthropic's Messages API takes the same route: the SDK's stream and count_tokens through Envoy."""
    import anthropic

    _, gateway, envoy = stack
    body = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": PROMPT}]}
    greedy = {"extra_body": {"temperature": 0}}
    proxied = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{envoy.http_port}", api_key="unused", max_retries=0
    )
    direct = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    with proxied, direct:
        with proxied.messages.stream(**body, **greedy) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed and streamed == direct.messages.create(**body, **greedy).content[0].text
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24
        counted = proxied.messages.count_tokens(model=MODEL, messages=body["messages"])
        assert counted.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_access_log_records_the_request_id_the_client_got(stack):
    _, _, envoy = stack
    response = _client(envoy).models.with_raw_response.list()
    request_id = response.headers["x-request-id"]
    assert [m.id for m in response.parse().data] == [MODEL]
    deadline = time.monotonic() + 30
    while not [e for e in envoy.access_log() if e["request_id"] == request_id]:
        # Envoy flushes access logs on an interval; wait for it, bounded.
        assert time.monotonic() < deadline, f"request id {request_id} never reached the access log"
        time.sleep(0.2)
    (entry,) = [e for e in envoy.access_log() if e["request_id"] == request_id]
    assert entry["path"] == "/v1/models" and entry["response_code"] == 200


def _image_probe(path, port: int) -> subprocess.CompletedProcess[str]:
    """Run an image's HEALTHCHECK command here, with the port variable the image sets."""
    command = list(dockerfiles.parse(path).final.one("HEALTHCHECK").value)
    assert command[:2] == ["CMD", "python"]
    env = dict(os.environ, CONDUIT_PORT=str(port))
    return subprocess.run([sys.executable, *command[2:]], env=env, capture_output=True, text=True, timeout=60)


def test_image_health_checks_pass_against_the_live_services(stack):
    engine, gateway, _ = stack
    assert _image_probe(ENGINE_DOCKERFILE, engine.port).returncode == 0
    assert _image_probe(GATEWAY_DOCKERFILE, gateway.port).returncode == 0
    nobody = free_port()
    assert _image_probe(ENGINE_DOCKERFILE, nobody).returncode != 0
    assert _image_probe(GATEWAY_DOCKERFILE, nobody).returncode != 0


def test_stopping_the_engine_makes_envoy_eject_it(stack):
    engine, _, envoy = stack
    engine.stop()
    # Active gRPC health checks fail against the stopped engine: Envoy flags the host.
    envoy.wait_for_health("engine", engine.address, "/failed_active_hc")
    with grpc.insecure_channel(f"127.0.0.1:{envoy.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as failure:
            engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=30)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.APIStatusError) as http_failure:
        _client(envoy).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert http_failure.value.status_code == 503
