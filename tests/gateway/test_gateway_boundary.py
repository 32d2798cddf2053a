"""The gateway process at its client-facing boundary: HTTPS, the admin API on its own port, bounded
request heads and bodies (slowloris), and SIGHUP re-reading the keys file and the certificate while a
stream stays open. The engine is the fake one (tests/support/fake_engine.py); nothing here is timed:
each slow-client test waits for the gateway's answer, whatever it takes. The gateway logs JSON lines at
debug level with --log-prompts, the most it ever logs, and still no key or token may appear.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL
from tests.support.certs import make_pki
from tests.support.fake_engine import FakeEngine
from tests.support.processes import free_port, start_gateway

pytestmark = pytest.mark.integration

OLD_KEY, NEW_KEY, ADMIN_KEY = "sk-old-key-123", "sk-new-key-456", "admin-key-789"
ENGINE_TOKEN = "fake-engine-token"


def write_keys(path, *entries: tuple[str, str]) -> None:
    path.write_text(json.dumps([{"name": name, "key": key} for name, key in entries]))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gateway-boundary")
    pki = make_pki(directory / "pki")
    shutil.copy(pki.server.cert, directory / "https.crt")
    shutil.copy(pki.server.key, directory / "https.key")
    write_keys(directory / "keys.json", ("old", OLD_KEY))
    (directory / "engine-token").write_text(ENGINE_TOKEN)
    admin_port = free_port()
    args = ["--tls-cert", str(directory / "https.crt"), "--tls-key", str(directory / "https.key")]
    args += ["--api-keys-file", str(directory / "keys.json"), "--admin-key", ADMIN_KEY]
    args += ["--admin-port", str(admin_port), "--header-timeout", "1", "--body-timeout", "1"]
    args += ["--max-header-bytes", "4096", "--log-level", "debug", "--log-format", "json", "--log-prompts"]
    args += ["--engine-auth-token-file", str(directory / "engine-token")]
    with FakeEngine(MODEL) as fake:
        gateway = start_gateway(fake.address, *args, https_ca=pki.ca)
        try:
            yield gateway, fake, pki, directory, admin_port
        finally:
            gateway.stop()


def verify(pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.ca))


def sdk(gateway, pki, key: str) -> openai.OpenAI:
    http_client = openai.DefaultHttpxClient(verify=verify(pki))
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, http_client=http_client)


def test_https_serves_clients_that_trust_the_ca_and_the_engine_gets_the_token(stack):
    gateway, fake, pki, _, _ = stack
    fake.reset()
    reply = sdk(gateway, pki, OLD_KEY).completions.create(model=MODEL, prompt=[1, 2], max_tokens=3)
    assert reply.usage.completion_tokens == 3
    assert fake.record.metadata[-1]["authorization"] == f"Bearer {ENGINE_TOKEN}"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{gateway.url}/health", verify=ssl.create_default_context(cafile=str(pki.other_ca)))
    assert httpx.get(f"{gateway.url}/health", verify=verify(pki)).status_code == 200


def test_the_admin_api_answers_on_its_own_port_only(stack):
    gateway, _, pki, _, admin_port = stack
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    admin_url = f"https://127.0.0.1:{admin_port}"
    with httpx.Client(verify=verify(pki), headers=auth, timeout=10) as client:
        assert client.get(f"{gateway.url}/admin/nodes").status_code == 404
        nodes = client.get(f"{admin_url}/admin/nodes")
        assert nodes.status_code == 200 and len(nodes.json()["nodes"]) == 1
        assert client.get(f"{admin_url}/v1/models").status_code == 404
        assert (
            client.get(f"{admin_url}/admin/nodes", headers={"Authorization": f"Bearer {OLD_KEY}"}).status_code
            == 401
        )


def raw_tls(gateway, pki) -> ssl.SSLSocket:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
    return verify(pki).wrap_socket(sock, server_hostname="localhost")


def read_all(sock: ssl.SSLSocket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_client_that_never_finishes_its_headers_gets_408_and_the_connection_closes(stack):
    gateway, _, pki, _, _ = stack
    with raw_tls(gateway, pki) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b'"code": "request_rejected"' in reply


def test_an_idle_connection_is_closed_too(stack):
    gateway, _, pki, _, _ = stack
    with raw_tls(gateway, pki) as sock:
        assert read_all(sock).startswith(b"HTTP/1.1 408")


def test_headers_over_the_limit_get_431(stack):
    gateway, _, pki, _, _ = stack
    with raw_tls(gateway, pki) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 5000)
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


def test_a_body_that_trickles_gets_408(stack):
    gateway, _, pki, _, _ = stack
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {OLD_KEY}\r\nContent-Length: 100\r\n\r\n"
    )
    with raw_tls(gateway, pki) as sock:
        sock.sendall(head.encode() + b'{"model": ')
        reply = read_all(sock)
    status, _, rest = reply.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout"
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"] == {
        "message": "The request body did not arrive within 1 seconds.",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def status_with(gateway, pki, key: str) -> int:
    return httpx.get(
        f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, verify=verify(pki)
    ).status_code


def test_sighup_revokes_a_key_and_adds_one_while_an_open_stream_finishes(stack):
    gateway, fake, pki, directory, _ = stack
    fake.reset()
    fake.script.hold_after = 2
    client = sdk(gateway, pki, OLD_KEY)
    try:
        stream = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=8, stream=True)
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices[0].text
        write_keys(directory / "keys.json", ("new", NEW_KEY))
        gateway.process.send_signal(signal.SIGHUP)
        wait_for(lambda: status_with(gateway, pki, OLD_KEY) == 401, "the old key refused")
        assert status_with(gateway, pki, NEW_KEY) == 200
        fake.release()
        texts = [first.choices[0].text, *(c.choices[0].text for c in chunks if c.choices)]
        assert len([t for t in texts if t]) == 8
    finally:
        fake.release()
        write_keys(directory / "keys.json", ("old", OLD_KEY))
        gateway.process.send_signal(signal.SIGHUP)
        wait_for(lambda: status_with(gateway, pki, OLD_KEY) == 200, "the old key back")


def test_sighup_re_reads_the_https_certificate(stack):
    gateway, _, pki, directory, _ = stack
    shutil.copy(pki.expired_server.cert, directory / "https.crt")
    shutil.copy(pki.expired_server.key, directory / "https.key")
    gateway.process.send_signal(signal.SIGHUP)

    def refused_as_expired() -> bool:
        try:
            httpx.get(f"{gateway.url}/health", verify=verify(pki))
        except httpx.ConnectError as exc:
            return "certificate has expired" in str(exc)
        return False

    try:
        wait_for(refused_as_expired, "the expired certificate served")
    finally:
        shutil.copy(pki.server.cert, directory / "https.crt")
        shutil.copy(pki.server.key, directory / "https.key")
        gateway.process.send_signal(signal.SIGHUP)
    wait_for(lambda: not refused_as_expired(), "the valid certificate back")
    assert httpx.get(f"{gateway.url}/health", verify=verify(pki)).status_code == 200


def test_a_sighup_with_a_broken_keys_file_keeps_the_keys(stack):
    gateway, _, pki, directory, _ = stack
    (directory / "keys.json").write_text("[{")
    gateway.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "keeping the API keys in force" in gateway.output_tail(), "the reload refused")
    assert status_with(gateway, pki, OLD_KEY) == 200
    write_keys(directory / "keys.json", ("old", OLD_KEY))


def test_no_key_or_token_ever_reaches_the_log(stack):
    gateway, _, pki, _, _ = stack
    # Keys in the query string (refused: only headers carry keys), and values that try to forge a line.
    with httpx.Client(base_url=gateway.url, verify=verify(pki), timeout=30) as http:
        assert http.get(f"/v1/models?api_key={OLD_KEY}").status_code == 401
        forged = '{"time": "2026-01-01T00:00:00.000+00:00", "level": "INFO", "message": "forged"}'
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "user": "u\n" + forged}
        headers = {"Authorization": f"Bearer {OLD_KEY}", "X-Request-Id": "a\tb"}
        assert http.post(f"/v1/completions?api_key={NEW_KEY}", json=body, headers=headers).status_code == 200
    log = gateway.output_tail(max_chars=10_000_000)
    assert "SIGHUP" in log and "/v1/completions" in log  # the log is the debug-level one, and full
    for secret in (OLD_KEY, NEW_KEY, ADMIN_KEY, ENGINE_TOKEN):
        assert secret not in log
    records = [json.loads(line) for line in log.splitlines() if line.strip()]
    assert any(" input=" in record["message"] for record in records)  # --log-prompts was in force
    assert not any(record["message"] == "forged" for record in records)
    assert any(
        record["message"].endswith('"GET /v1/models?[query redacted] HTTP/1.1" 401') for record in records
    )
