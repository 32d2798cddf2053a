"""The engine's boundary through real handshakes on 127.0.0.1: TLS, mTLS, the bearer token, exemptions,
and re-reading certificates and the token (SIGHUP) while a stream stays open.

Certificates come from tests/support/certs.py (made with `cryptography` for each run). Every refusal is
followed by a call that works: a refused client never stops the engine serving.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_common.secret_files import SecretFileError
from conduit_engine.config import EngineConfig, SecurityConfig
from conduit_engine.entrypoints.security import MALFORMED_TOKEN, MISSING_TOKEN, WRONG_TOKEN, ServerSecurity
from tests.engine.support.server_thread import ServerThread, engine_config
from tests.support.certs import bearer, make_pki, tls_channel
from tests.support.processes import free_port, start_engine
from tests.support.stories import PROMPT

pytestmark = pytest.mark.integration

TOKEN = "s3cret-engine-token"


def generate_request(max_tokens: int = 4) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )


def token_count(stream) -> int:
    return sum(len(message.token_ids) for message in stream)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def files(pki, tmp_path_factory):
    """The engine's own copies of its certificate, key and token: tests rewrite them as a rotation would."""
    directory = tmp_path_factory.mktemp("engine-secrets")
    shutil.copy(pki.server.cert, directory / "tls.crt")
    shutil.copy(pki.server.key, directory / "tls.key")
    (directory / "token").write_text(TOKEN + "\n")
    return directory


@pytest.fixture(scope="module")
def engine(stories_path, pki, files):
    """mTLS (client CA: the test CA) and a token."""
    security = SecurityConfig(
        tls_cert=str(files / "tls.crt"),
        tls_key=str(files / "tls.key"),
        tls_client_ca=str(pki.ca),
        auth_token_file=str(files / "token"),
    )
    base = engine_config(stories_path)
    server = ServerThread(EngineConfig(base.model, base.cache, base.scheduler, base.server, security)).start()
    yield server
    server.stop()


@pytest.fixture
def trusted(engine, pki):
    with tls_channel(engine.address, pki.ca, pki.client) as channel:
        yield channel


def assert_serving(engine, pki) -> None:
    """A well-behaved client still gets tokens."""
    with tls_channel(engine.address, pki.ca, pki.client) as channel:
        stub = pb_grpc.EngineStub(channel)
        assert token_count(stub.Generate(generate_request(), metadata=bearer(TOKEN), timeout=30)) == 4


def test_mtls_with_the_token_generates(trusted):
    stub = pb_grpc.EngineStub(trusted)
    assert token_count(stub.Generate(generate_request(6), metadata=bearer(TOKEN), timeout=30)) == 6
    load = stub.GetLoad(pb.GetLoadRequest(), metadata=bearer(TOKEN), timeout=10)
    assert load.running_requests == 0


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), MISSING_TOKEN),
        (bearer("not-the-token"), WRONG_TOKEN),
        (bearer(TOKEN + "x"), WRONG_TOKEN),
        ((("authorization", f"Basic {TOKEN}"),), MALFORMED_TOKEN),
    ],
    ids=["missing", "wrong", "longer", "not-bearer"],
)
def test_every_rpc_without_the_right_token_is_unauthenticated(trusted, engine, pki, metadata, message):
    stub = pb_grpc.EngineStub(trusted)
    calls = [
        lambda: list(stub.Generate(generate_request(), metadata=metadata, timeout=10)),
        lambda: stub.GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=10),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10),
        lambda: stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=10),
        lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=10),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
    assert_serving(engine, pki)


def test_an_unknown_method_without_the_token_is_unauthenticated_too(trusted):
    call = trusted.unary_unary("/conduit.engine.v1.Engine/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as refused:
        call(b"", timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_token_but_reflection_does(trusted):
    reply = health_pb2_grpc.HealthStub(trusted).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(trusted)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with pytest.raises(grpc.RpcError) as refused:
        list(reflection.ServerReflectionInfo(iter([request]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (reply,) = reflection.ServerReflectionInfo(iter([request]), metadata=bearer(TOKEN), timeout=10)
    assert "conduit.engine.v1.Engine" in {s.name for s in reply.list_services_response.service}


def _handshake_failure(channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failed:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    return failed.value


def test_a_client_trusting_another_ca_refuses_the_engine(engine, pki):
    with tls_channel(engine.address, pki.other_ca, pki.client) as channel:
        failure = _handshake_failure(channel)
    assert "CERTIFICATE_VERIFY_FAILED" in failure.details()
    assert "unable to get local issuer certificate" in failure.details()
    assert_serving(engine, pki)


@pytest.mark.parametrize("client", [None, "expired_client", "rogue_client"])
def test_under_mtls_the_engine_refuses_clients_without_a_valid_certificate(engine, pki, client):
    with tls_channel(engine.address, pki.ca, getattr(pki, client) if client else None) as channel:
        _handshake_failure(channel)
    assert_serving(engine, pki)


def test_a_plaintext_client_cannot_talk_to_a_tls_engine(engine, pki):
    with grpc.insecure_channel(engine.address) as channel:
        _handshake_failure(channel)
    assert_serving(engine, pki)


def _reload(engine) -> None:
    engine.loop.call_soon_threadsafe(engine.server.security.reload)
    done = threading.Event()
    engine.loop.call_soon_threadsafe(done.set)
    assert done.wait(10)


def test_a_reload_switches_certificate_and_token_for_new_calls_while_an_open_stream_finishes(
    engine, pki, files
):
    with tls_channel(engine.address, pki.ca, pki.client) as channel:
        stub = pb_grpc.EngineStub(channel)
        stream = stub.Generate(generate_request(200), metadata=bearer(TOKEN), timeout=60)
        first = next(stream)
        try:
            shutil.copy(pki.expired_server.cert, files / "tls.crt")
            shutil.copy(pki.expired_server.key, files / "tls.key")
            (files / "token").write_text("rotated-token\n")
            _reload(engine)
            # New connections see the expired certificate; the open stream's connection is untouched.
            with tls_channel(engine.address, pki.ca, pki.client) as fresh:
                failure = _handshake_failure(fresh)
            assert "certificate has expired" in failure.details()
            rest = token_count(stream)
            assert len(first.token_ids) + rest == 200
            # On that same connection, new calls need the new token.
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetLoad(pb.GetLoadRequest(), metadata=bearer(TOKEN), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetLoad(pb.GetLoadRequest(), metadata=bearer("rotated-token"), timeout=10)
        finally:
            shutil.copy(pki.server.cert, files / "tls.crt")
            shutil.copy(pki.server.key, files / "tls.key")
            (files / "token").write_text(TOKEN)
            _reload(engine)
    assert_serving(engine, pki)


def test_a_reload_that_cannot_read_the_files_keeps_the_old_ones(engine, pki, files):
    (files / "token").write_text("   \n")
    shutil.copy(pki.other_server.key, files / "tls.key")  # not the key of tls.crt
    try:
        _reload(engine)
        assert_serving(engine, pki)
    finally:
        (files / "token").write_text(TOKEN)
        shutil.copy(pki.server.key, files / "tls.key")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tls_key": "/nonexistent/tls.key"}, "--tls-key: cannot read /nonexistent/tls.key"),
        ({"auth_token_file": "EMPTY"}, "--auth-token-file: EMPTY is empty"),
        ({"tls_key": "OTHER_KEY"}, "--tls-cert: CERT with its key OTHER_KEY is not a usable certificate"),
        ({"tls_client_ca": "TOKEN"}, "--tls-client-ca: TOKEN holds no PEM CA certificate"),
    ],
)
def test_unusable_files_fail_at_start_naming_the_flag(pki, tmp_path, change, message):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text(TOKEN)
    names = {
        "EMPTY": str(tmp_path / "empty"),
        "OTHER_KEY": str(pki.other_server.key),
        "TOKEN": str(tmp_path / "token"),
        "CERT": str(pki.server.cert),
    }
    fields = {"tls_cert": str(pki.server.cert), "tls_key": str(pki.server.key), **change}
    fields = {key: names.get(value, value) for key, value in fields.items()}
    for name, path in names.items():
        message = message.replace(name, path)
    with pytest.raises(SecretFileError) as failed:
        ServerSecurity(SecurityConfig(**fields))
    assert str(failed.value).startswith(message)


def test_config_refuses_half_a_tls_setup():
    with pytest.raises(ValueError, match="--tls-cert and --tls-key: give both"):
        SecurityConfig(tls_cert="a.crt")
    with pytest.raises(ValueError, match="--tls-client-ca: needs --tls-cert"):
        SecurityConfig(tls_client_ca="ca.crt")


def test_reflection_public_and_sighup_on_a_real_engine_process(stories_path, pki, tmp_path):
    """The CLI flags end to end, TLS without client certificates: reflection is open with
    --reflection-public; SIGHUP swaps the token while a stream on the old connection finishes."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    flags = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    flags += ["--auth-token-file", str(token), "--reflection-public", "true", "--kv-cache-blocks", "64"]
    # The most the engine ever logs (debug, JSON, prompts and completions): still never a token.
    flags += ["--log-level", "DEBUG", "--log-format", "json", "--log-prompts"]
    metrics_port = free_port()  # plain HTTP without the token, beside the TLS gRPC port
    flags += ["--metrics-port", str(metrics_port)]
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    engine = start_engine(stories_path, *flags, credentials=credentials)
    try:
        with tls_channel(engine.address, pki.ca) as channel:
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (reply,) = reflection.ServerReflectionInfo(iter([request]), timeout=10)
            assert "conduit.engine.v1.Engine" in {s.name for s in reply.list_services_response.service}
            stub = pb_grpc.EngineStub(channel)
            stream = stub.Generate(generate_request(150), metadata=bearer(TOKEN), timeout=60)
            first = next(stream)
            token.write_text("new-token")
            engine.process.send_signal(signal.SIGHUP)
            for _ in range(100):
                try:
                    stub.GetLoad(pb.GetLoadRequest(), metadata=bearer("new-token"), timeout=10)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    threading.Event().wait(0.1)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetLoad(pb.GetLoadRequest(), metadata=bearer(TOKEN), timeout=10)
            assert refused.value.details() == WRONG_TOKEN
            assert len(first.token_ids) + token_count(stream) == 150
        assert engine.process.poll() is None
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert scrape.status_code == 200 and 'conduit_engine_state{state="serving"} 1.0' in scrape.text
        # The exec probe the chart uses when the kubelet's plaintext gRPC probe cannot reach a TLS engine.
        probe = [sys.executable, "-m", "conduit_engine.entrypoints.health_probe", "--address", engine.address]
        assert subprocess.run([*probe, "--ca", str(pki.ca)], timeout=60).returncode == 0
        refused = subprocess.run(
            [*probe, "--ca", str(pki.other_ca)], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 1
        assert (
            "is not SERVING: UNAVAILABLE" in refused.stderr and "CERTIFICATE_VERIFY_FAILED" in refused.stderr
        )
        log = engine.output_tail(max_chars=1_000_000)
        assert TOKEN not in log and "new-token" not in log
        records = [json.loads(line) for line in log.splitlines() if line.strip()]
        assert any("SIGHUP" in record["message"] for record in records)
    finally:
        assert engine.stop() == 0
