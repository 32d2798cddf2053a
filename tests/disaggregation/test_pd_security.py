"""Disaggregation with every gRPC hop secured: mTLS and a bearer token from the gateway to the engines and
between the engines (PullKv, ReleaseKv), on real engine processes.

The decode engine dials the prefill engine with its --engine-tls-* certificate and --engine-auth-token-file
token; a decode engine without that token is refused by the source (UNAUTHENTICATED), recomputes the
prompt itself and still streams the right tokens; the source's lease then frees the blocks.
"""

from __future__ import annotations

import grpc
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.support.certs import bearer, make_pki, tls_channel
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.processes import require_shared, start_engine
from tests.support.stories import KNOWN_STORY, KNOWN_STORY_TOKENS, MODEL

pytestmark = pytest.mark.integration

TOKEN = "engine-secret-token"


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """(PKI, token file, flags every engine serves with)."""
    directory = tmp_path_factory.mktemp("pki")
    pki = make_pki(directory)
    token = directory / "token"
    token.write_text(TOKEN)
    serve = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    serve += ["--tls-client-ca", str(pki.ca), "--auth-token-file", str(token)]
    return pki, token, serve


def dial_flags(pki, token=None) -> list[str]:
    """Towards other engines: trust the CA, present the client certificate, and the token if given."""
    flags = ["--engine-tls-ca", str(pki.ca), "--engine-tls-cert", str(pki.client.cert)]
    flags += ["--engine-tls-key", str(pki.client.key)]
    return flags + (["--engine-auth-token-file", str(token)] if token is not None else [])


@pytest.fixture(scope="module")
def engines(secure):
    pki, token, serve = secure
    model = require_shared(f"models/{MODEL}")
    probe = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client.key.read_bytes(), pki.client.cert.read_bytes()
    )
    with (
        start_engine(
            model, "--role", "prefill", "--kv-transfer-lease-seconds", "2", *serve, credentials=probe
        ) as prefill,
        start_engine(model, "--role", "decode", *serve, *dial_flags(pki, token), credentials=probe) as decode,
        start_engine(model, "--role", "decode", *serve, *dial_flags(pki), credentials=probe) as tokenless,
    ):
        yield prefill, decode, tokenless


def load(secure, address: str) -> engine_pb2.GetLoadResponse:
    pki, _, _ = secure
    with tls_channel(address, pki.ca, pki.client) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10, metadata=bearer(TOKEN))


def gateway(secure, prefill, decode) -> GatewayThread:
    pki, token, _ = secure
    return GatewayThread(
        [],
        prefill_engines=(prefill.address,),
        decode_engines=(decode.address,),
        engine_tls_ca=str(pki.ca),
        engine_tls_cert=str(pki.client.cert),
        engine_tls_key=str(pki.client.key),
        engine_auth_token_file=str(token),
    )


def known_story(url: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        result = client.completions.create(
            model=MODEL, prompt=[1], max_tokens=KNOWN_STORY_TOKENS, temperature=0
        )
    return result.choices[0].text.strip()


def test_the_decode_engine_pulls_over_mtls_with_its_token(secure, engines):
    prefill, decode, _ = engines
    before = load(secure, decode.address).kv_bytes_pulled
    with gateway(secure, prefill, decode) as gw:
        assert known_story(gw.url) == KNOWN_STORY
    assert load(secure, decode.address).kv_bytes_pulled > before
    assert load(secure, prefill.address).kv_transfers_pending == 0


def test_a_decode_engine_without_the_token_is_refused_and_recomputes(secure, engines):
    prefill, _, tokenless = engines
    with gateway(secure, prefill, tokenless) as gw:
        assert known_story(gw.url) == KNOWN_STORY
    assert load(secure, tokenless.address).kv_bytes_pulled == 0
    assert "UNAUTHENTICATED" in tokenless.output_tail()
    # Its ReleaseKv was refused too: the two-second lease frees the prefill engine's blocks.
    wait_for(lambda: load(secure, prefill.address).kv_blocks_used == 0, "the lease to free the blocks", 800)
