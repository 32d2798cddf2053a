"""Envoy with the chart's TLS (ci/secure-values.yaml): TLS on both listeners, HTTPS to the gateway, mTLS
to the engines. `envoy --mode validate` on the rendered config, then an end-to-end run on 127.0.0.1 of
engine (stories260K; mTLS and a token) + gateway (HTTPS; mTLS and the token towards the engine) + Envoy,
with test certificates standing in for the Secrets mounted under /etc/envoy.
"""

from __future__ import annotations

import shutil
import ssl

import grpc
import httpx
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.deploy import chart_render, envoy_config
from tests.deploy.chart_render import NAMESPACE, find
from tests.deploy.envoy_process import stack_behind_envoy
from tests.deploy.strict_yaml import load
from tests.support.certs import bearer, make_pki
from tests.support.processes import require_shared, start_engine, start_gateway
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.deploy

TOKEN = "envoy-e2e-token"
ENGINE_NAME = f"conduit-engine-headless.{NAMESPACE}.svc.cluster.local"
GATEWAY_NAME = f"conduit-gateway.{NAMESPACE}.svc.cluster.local"


def rendered_tls_config() -> str:
    objects = chart_render.manifests(chart_render.render(chart_render.values("secure")))
    return find(objects, "ConfigMap", "conduit-envoy")["data"]["envoy.yaml"]


def lay_out_secrets(directory, pki):
    """The files the chart mounts under /etc/envoy, from the test PKI (one server certificate with every
    name serves as Envoy's, the gateway's and the engine's)."""
    files = {
        "tls/tls.crt": pki.server.cert,
        "tls/tls.key": pki.server.key,
        "gateway-ca/ca.crt": pki.ca,
        "engine-tls/ca.crt": pki.ca,
        "engine-tls/tls.crt": pki.client.cert,
        "engine-tls/tls.key": pki.client.key,
    }
    for target, source in files.items():
        (directory / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, directory / target)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), server_names=(ENGINE_NAME, GATEWAY_NAME))


@pytest.fixture(scope="module")
def envoy_files(tmp_path_factory, pki):
    directory = tmp_path_factory.mktemp("etc-envoy")
    lay_out_secrets(directory, pki)
    return directory


def local_config(envoy_files) -> dict:
    return load(rendered_tls_config().replace("/etc/envoy/", f"{envoy_files}/"))


def test_the_chart_puts_tls_on_both_listeners_and_both_clusters(envoy_files):
    config = local_config(envoy_files)
    for name in (envoy_config.HTTP_LISTENER, envoy_config.GRPC_LISTENER):
        (chain,) = envoy_config.listener(config, name)["filter_chains"]
        context = chain["transport_socket"]["typed_config"]
        assert context["@type"].endswith("DownstreamTlsContext")
        assert context["common_tls_context"]["alpn_protocols"] == ["h2", "http/1.1"]
    engine_tls = envoy_config.cluster(config, "engine")["transport_socket"]["typed_config"]
    assert engine_tls["common_tls_context"]["alpn_protocols"] == ["h2"]
    assert len(engine_tls["common_tls_context"]["tls_certificates"]) == 1  # mTLS: Envoy's client cert
    assert envoy_config.cluster(config, "gateway")["transport_socket"]["typed_config"]["sni"] == GATEWAY_NAME


def test_envoy_validates_the_rendered_tls_config(envoy_files, tmp_path):
    path = tmp_path / "envoy.yaml"
    path.write_text(rendered_tls_config().replace("/etc/envoy/", f"{envoy_files}/"))
    result = envoy_config.validate(path)
    assert result.returncode == 0, result.stderr + result.stdout


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pki, envoy_files):
    model = require_shared(f"models/{MODEL}")
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text(TOKEN)
    engine_flags = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    engine_flags += ["--tls-client-ca", str(pki.ca), "--auth-token-file", str(token), "--max-num-seqs", "4"]
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client.key.read_bytes(), pki.client.cert.read_bytes()
    )
    gateway_flags = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    gateway_flags += ["--engine-tls-ca", str(pki.ca), "--engine-tls-server-name", ENGINE_NAME]
    gateway_flags += ["--engine-tls-cert", str(pki.client.cert), "--engine-tls-key", str(pki.client.key)]
    gateway_flags += ["--engine-auth-token-file", str(token)]
    with stack_behind_envoy(
        tmp_path_factory.mktemp("envoy"),
        lambda: start_engine(model, *engine_flags, credentials=credentials),
        lambda engine: start_gateway(engine.address, *gateway_flags, https_ca=pki.ca),
        config=local_config(envoy_files),
    ) as processes:
        yield processes


def trust(ca) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def test_https_through_envoy_streams_from_the_engine(stack, pki):
    _, _, envoy = stack
    http_client = openai.DefaultHttpxClient(verify=trust(pki.ca))
    with openai.OpenAI(
        base_url=f"https://localhost:{envoy.http_port}/v1",
        api_key="none",
        max_retries=0,
        http_client=http_client,
    ) as client:
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
    assert chunks[-1].usage.completion_tokens == 12
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://localhost:{envoy.http_port}/health", verify=trust(pki.other_ca))


def test_grpc_through_envoy_over_tls_needs_the_token(stack, pki):
    _, _, envoy = stack
    request = engine_pb2.GenerateRequest(
        text=PROMPT, sampling=engine_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    with grpc.secure_channel(f"localhost:{envoy.grpc_port}", credentials) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        messages = list(stub.Generate(request, metadata=bearer(TOKEN), timeout=60))
        assert sum(len(m.token_ids) for m in messages) == 8
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(f"127.0.0.1:{envoy.grpc_port}") as plaintext:
        with pytest.raises(grpc.RpcError) as failed:
            engine_pb2_grpc.EngineStub(plaintext).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
