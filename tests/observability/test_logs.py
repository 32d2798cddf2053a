"""Logs of real engine and gateway processes serving real requests (stories260K): JSON lines, each line
about a request carrying its request id, and no prompt or completion text unless --log-prompts."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.support.processes import ManagedProcess, start_engine, start_gateway
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

# Words the services never log by themselves: if they appear, a prompt leaked.
PROMPT = "The purple giraffe whispered to the lighthouse"
JSON_LOGS = ("--log-format", "json")


def _serve_and_log(stories_path, *extra: str) -> tuple[list[str], list[str], list[str], dict[str, str]]:
    """Serve three requests (completion, streamed chat, two prompts) with `extra` flags on both services;
    returns (the completions' texts, the engine's log lines, the gateway's log lines, and the gateway's
    own request id of each client id: the base of the response's id)."""
    texts: list[str] = []
    ids: dict[str, str] = {}
    with start_engine(stories_path, *JSON_LOGS, "--log-level", "DEBUG", *extra) as engine:
        with start_gateway(engine.address, *JSON_LOGS, "--log-level", "debug", *extra) as gateway:
            with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as client:
                completion = client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=24,
                    temperature=0,
                    extra_headers={"x-request-id": "log-1"},
                )
                texts.append(completion.choices[0].text)
                ids["log-1"] = completion.id.removeprefix("cmpl-")
                chunks = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": PROMPT}],
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    extra_headers={"x-request-id": "log-2"},
                )
                chunks = list(chunks)
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
                ids["log-2"] = chunks[0].id.removeprefix("chatcmpl-")
                two = client.completions.create(
                    model=MODEL,
                    prompt=[PROMPT, PROMPT + " again"],
                    max_tokens=24,
                    temperature=0,
                    extra_headers={"x-request-id": "log-3"},
                )
                texts += [choice.text for choice in two.choices]
                ids["log-3"] = two.id.removeprefix("cmpl-")
        gateway_lines = _lines(gateway)
    return texts, _lines(engine), gateway_lines, ids


def _lines(process: ManagedProcess) -> list[str]:
    process.stop()
    return [line for line in process.log_path.read_text().splitlines() if line.strip()]


def _records(lines: list[str]) -> list[dict]:
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    return records


def _fragments(text: str) -> list[str]:
    """The pieces of `text` that no log escaping changes (quotes, backslashes, newlines split it)."""
    return [piece for piece in re.split(r"[\\'\"\n]", text) if len(piece.strip()) >= 12]


def _messages(lines: list[str]) -> str:
    return "\n".join(record["message"] for record in _records(lines))


def _check_request_ids(
    records: list[dict], ids: dict[str, tuple[str, ...]], field: str = "request_id"
) -> None:
    """Every line that names a request carries its id (in `field`), and each request has its lines."""
    for record in records:
        named = [rid for rid in ids if rid in record["message"]]
        for rid in named:
            assert record.get(field, "").startswith(rid), record
    for rid, expected in ids.items():
        mine = [r["message"] for r in records if r.get(field, "").startswith(rid)]
        for fragment in expected:
            assert any(fragment in message for message in mine), (rid, fragment, mine)


def test_logs_never_hold_prompts_or_completions_and_name_their_requests(stories_path):
    texts, engine_lines, gateway_lines, ids = _serve_and_log(stories_path)
    fragments = [piece for text in texts for piece in _fragments(text)]
    assert len(fragments) >= len(texts)
    for lines in (engine_lines, gateway_lines):
        for log in ("\n".join(lines), _messages(lines)):
            assert "purple giraffe" not in log
            for piece in fragments:
                assert piece not in log
    # The engine gets one request id per prompt (the gateway's own id, "-0", "-1" for several), never
    # the client's.
    assert len(set(ids.values())) == 3 and not set(ids.values()) & set(ids)
    _check_request_ids(
        _records(engine_lines), {ids[rid]: ("queued", "finished") for rid in ("log-1", "log-2", "log-3")}
    )
    assert not any(r.get("request_id", "").startswith("log-") for r in _records(engine_lines))
    # The gateway's own line and uvicorn's access line of each request carry both ids.
    expected = {
        "log-1": ("completions", "POST /v1/completions"),
        "log-2": ("chat", "POST /v1/chat/completions"),
    }
    gateway_records = _records(gateway_lines)
    _check_request_ids(gateway_records, {ids[rid]: lines for rid, lines in expected.items()})
    _check_request_ids(gateway_records, expected, field="client_request_id")
    for record in gateway_records:
        if "client_request_id" in record:
            assert record["request_id"] == ids[record["client_request_id"]], record


def test_log_prompts_puts_prompts_and_completions_in_both_logs(stories_path):
    texts, engine_lines, gateway_lines, _ = _serve_and_log(stories_path, "--log-prompts")
    for messages in (_messages(engine_lines), _messages(gateway_lines)):
        assert PROMPT in messages
        for text in texts:
            for piece in _fragments(text):
                assert piece in messages


def test_a_worker_process_logs_in_the_engines_json_format(stories_path):
    """The model in a worker process: its lines (the shard's loading) are JSON objects too, marked with
    its rank, and its weight-loading progress bar is off like the engine's."""
    with start_engine(stories_path, *JSON_LOGS, "--log-level", "DEBUG", "--worker-process") as engine:
        with start_gateway(engine.address) as gateway:
            with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as client:
                completion = client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0
                )
                assert completion.usage.completion_tokens == 8
    records = _records(_lines(engine))
    assert any(r["message"].startswith("worker rank 0: loaded shard 0/1") for r in records)
    assert not any("Loading weights" in r["message"] for r in records)


# A line an attacker wants in the log, as the text format writes a real one.
FORGED = "2026-01-01 00:00:00,000 INFO conduit_gateway.http.admin: admin removed node 10.0.0.9:50051"
QUERY_KEY = "sk-in-the-query-4242"
API_KEY = "sk-tenant-key-1717"


def test_text_logs_escape_what_clients_send_and_never_hold_a_query_key(stories_path):
    """Text-format logs of a real run where clients send a `user` and a model name with a newline and a
    fake log line, an X-Request-Id with control characters, and a key in the query string; a gRPC client
    sends such a request_id to the engine. Each record stays one line, no line is forged, no key shows."""
    with start_engine(stories_path, "--log-level", "DEBUG") as engine:
        with start_gateway(engine.address, "--api-key", API_KEY, "--log-level", "debug") as gateway:
            auth = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.Client(base_url=gateway.url, timeout=60, headers=auth) as http:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "user": "tenant\n" + FORGED}
                assert http.post("/v1/completions", json=body).status_code == 200
                odd_id = {"X-Request-Id": "id\twith\ttabs"}
                assert http.post("/v1/completions", json=body, headers=odd_id).status_code == 200
                wrong_model = {"model": "nope\r\n" + FORGED, "prompt": "Hi", "max_tokens": 2}
                assert http.post("/v1/completions", json=wrong_model).status_code == 404
                served = http.post(f"/v1/completions?api_key={QUERY_KEY}", json=body)
                assert served.status_code == 200
            refused = httpx.get(f"{gateway.url}/v1/models?api_key={QUERY_KEY}", timeout=60)
            assert refused.status_code == 401
            with grpc.insecure_channel(engine.address) as channel:
                sampling = engine_pb2.SamplingParams(max_tokens=2)
                request = engine_pb2.GenerateRequest(
                    request_id="grpc\n" + FORGED, text="Hi", sampling=sampling
                )
                assert list(engine_pb2_grpc.EngineStub(channel).Generate(request))[-1].finished
        gateway_log, engine_log = _text(gateway), _text(engine)
    for log in (gateway_log, engine_log):
        assert not any(line.startswith(FORGED[:30]) for line in log.splitlines())
        assert QUERY_KEY not in log and API_KEY not in log
        assert not any(char in log for char in "\r\t")
    assert "user=tenant\\n" + FORGED in gateway_log  # logged, escaped, on the request's own line
    assert "POST /v1/completions?[query redacted] HTTP/1.1" in gateway_log
    assert "GET /v1/models?[query redacted] HTTP/1.1" in gateway_log
    assert "request grpc\\n" + FORGED in engine_log


def _text(process: ManagedProcess) -> str:
    process.stop()
    return process.log_path.read_text()
