"""Gateway → engine over real handshakes: an engine process (stories260K) with mTLS and a bearer token,
and in-process gateways dialling it with the right or a wrong CA, client certificate or token.

A gateway that cannot authenticate never routes to the engine (503, and its log says why), and the
engine keeps serving the gateway that can.
"""

from __future__ import annotations

import logging
import signal

import grpc
import httpx
import openai
import pytest

from tests.gateway.sse import parse_events
from tests.support.certs import make_pki
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.processes import start_engine, start_gateway
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

TOKEN = "gateway-to-engine-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokens")
    (directory / "right").write_text(TOKEN + "\n")
    (directory / "wrong").write_text("not-" + TOKEN)
    return directory


@pytest.fixture(scope="module")
def engine(stories_path, pki, token_files):
    flags = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    flags += ["--tls-client-ca", str(pki.ca), "--auth-token-file", str(token_files / "right")]
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client.key.read_bytes(), pki.client.cert.read_bytes()
    )
    process = start_engine(stories_path, *flags, "--kv-cache-blocks", "64", credentials=credentials)
    yield process
    process.stop()


def tls_options(pki, token_files, **change) -> dict[str, object]:
    options = {
        "engine_tls_ca": str(pki.ca),
        "engine_tls_cert": str(pki.client.cert),
        "engine_tls_key": str(pki.client.key),
        "engine_auth_token_file": str(token_files / "right"),
    }
    return {**options, **change}


@pytest.fixture(scope="module")
def good_gateway(engine, pki, token_files):
    with GatewayThread([engine.address], **tls_options(pki, token_files)) as gateway:
        yield gateway


def complete(gateway, max_tokens: int = 5):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as client:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)


def test_a_gateway_with_the_ca_its_certificate_and_the_token_serves(good_gateway):
    assert httpx.get(f"{good_gateway.url}/health", timeout=10).status_code == 200
    assert complete(good_gateway).usage.completion_tokens == 5


@pytest.mark.parametrize(
    ("change", "logged"),
    [
        ({"engine_tls_ca": "other_ca"}, "health check failed: UNAVAILABLE"),
        ({"engine_tls_cert": None, "engine_tls_key": None}, "health check failed: UNAVAILABLE"),
        (
            {"engine_tls_cert": "expired_client.cert", "engine_tls_key": "expired_client.key"},
            "health check failed: UNAVAILABLE",
        ),
        (
            {"engine_tls_cert": "rogue_client.cert", "engine_tls_key": "rogue_client.key"},
            "health check failed: UNAVAILABLE",
        ),
        ({"engine_auth_token_file": "wrong"}, "GetModelInfo failed: UNAUTHENTICATED"),
        ({"engine_auth_token_file": None}, "GetModelInfo failed: UNAUTHENTICATED"),
    ],
    ids=[
        "wrong-ca",
        "no-client-cert",
        "expired-client-cert",
        "foreign-client-cert",
        "wrong-token",
        "no-token",
    ],
)
def test_a_gateway_that_cannot_authenticate_never_routes_to_the_engine(
    engine, good_gateway, pki, token_files, change, logged, caplog
):
    def resolve(value):
        if value is None or value == "wrong":
            return None if value is None else str(token_files / value)
        obj = pki
        for part in value.split("."):
            obj = getattr(obj, part)
        return str(obj)

    options = tls_options(pki, token_files, **{k: resolve(v) for k, v in change.items()})
    with caplog.at_level(logging.WARNING, logger="conduit_gateway"):
        with GatewayThread([engine.address], **options) as bad:
            assert httpx.get(f"{bad.url}/health", timeout=10).status_code == 503
            with pytest.raises(openai.APIStatusError) as refused:
                complete(bad)
            assert refused.value.status_code == 503
            assert refused.value.body["code"] == "engine_unavailable"
    assert any(logged in record.getMessage() for record in caplog.records), caplog.text
    assert TOKEN not in caplog.text
    # The engine did not mind: the authenticated gateway is served as before.
    assert complete(good_gateway).usage.completion_tokens == 5


def test_an_admin_added_engine_over_verified_tls_receives_the_token(engine, pki, token_files):
    # The engine requires mTLS and the token: it serves requests only if the gateway sent both.
    admin_key = "admin-secret"
    with GatewayThread([], admin_keys=(admin_key,), **tls_options(pki, token_files)) as gateway:
        headers = {"Authorization": f"Bearer {admin_key}"}
        added = httpx.post(
            f"{gateway.url}/admin/nodes", json={"address": engine.address}, headers=headers, timeout=30
        )
        assert (added.status_code, added.json()["source"]) == (201, "admin")
        wait_for(
            lambda: (
                httpx.get(f"{gateway.url}/admin/nodes/{engine.address}", headers=headers).json()["state"]
                == "serving"
            ),
            "the admin-added engine to serve",
        )
        assert complete(gateway).usage.completion_tokens == 5


def test_a_new_engine_token_goes_out_on_a_new_generate_stream_and_the_open_one_finishes(
    engine, pki, token_files, tmp_path
):
    """SIGHUP with a changed token file: a stream open on the GenerateStream that carried the old token
    finishes there; the next request opens a new GenerateStream, which carries the new token (here a
    wrong one: refused), and the right one again serves."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    flags = ["--engine-tls-ca", str(pki.ca), "--engine-tls-cert", str(pki.client.cert)]
    flags += ["--engine-tls-key", str(pki.client.key), "--engine-auth-token-file", str(token)]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    def reloaded(gateway, times: int) -> None:
        gateway.process.send_signal(signal.SIGHUP)
        wait_for(
            lambda: gateway.output_tail(1_000_000).count("the engines' auth token changed") >= times,
            "the reload",
        )

    with start_gateway(engine.address, *flags) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                lines = (line for line in response.iter_lines() if line)
                text = parse_events(next(lines) + "\n\n")[0]["choices"][0]["text"]
                engine.process.send_signal(signal.SIGSTOP)  # the stream stays open across the reload
                try:
                    token.write_text("not-" + TOKEN)
                    reloaded(gateway, 1)
                finally:
                    engine.process.send_signal(signal.SIGCONT)
                events = [parse_events(line + "\n\n")[0] for line in lines if line != "data: [DONE]"]
            assert not any("error" in event for event in events)
            text += "".join(event["choices"][0]["text"] for event in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code >= 500, refused.text  # the new stream carried the wrong token
            token.write_text(TOKEN)
            reloaded(gateway, 2)
            served = client.post("/v1/completions", json=body)
            assert served.status_code == 200, served.text
            assert served.json()["choices"][0]["text"] == text


def test_a_token_rotated_on_the_engine_refuses_new_requests_on_an_open_generate_stream(
    stories_path, tmp_path
):
    """The engine checks the token at each request opened on a GenerateStream, as at the start of each
    Generate call: after SIGHUP rotates its token, the gateway's open stream gets no new request through
    (one running meanwhile finishes) until the gateway presents the new token too."""
    engine_token, gateway_token = tmp_path / "engine-token", tmp_path / "gateway-token"
    engine_token.write_text(TOKEN)
    gateway_token.write_text(TOKEN)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    def reloaded(process, line: str, times: int) -> None:
        process.process.send_signal(signal.SIGHUP)
        wait_for(lambda: process.output_tail(1_000_000).count(line) >= times, "the reload")

    with (
        start_engine(
            stories_path, "--auth-token-file", str(engine_token), "--kv-cache-blocks", "64"
        ) as engine,
        start_gateway(engine.address, "--engine-auth-token-file", str(gateway_token)) as gateway,
        httpx.Client(base_url=gateway.url, timeout=60) as client,
    ):
        expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]  # the stream opens
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = (line for line in response.iter_lines() if line)
            text = parse_events(next(lines) + "\n\n")[0]["choices"][0]["text"]
            engine_token.write_text("rotated-" + TOKEN)
            reloaded(engine, "re-read the auth token", 1)
            events = [parse_events(line + "\n\n")[0] for line in lines if line != "data: [DONE]"]
        assert not any("error" in event for event in events)
        assert text + "".join(event["choices"][0]["text"] for event in events) == expected
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code >= 500, refused.text
        assert "re-read the auth token" in engine.output_tail(1_000_000)
        assert "refused a GenerateStream request: " in engine.output_tail(1_000_000)
        gateway_token.write_text("rotated-" + TOKEN)
        reloaded(gateway, "the engines' auth token changed", 1)
        served = client.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["text"] == expected
