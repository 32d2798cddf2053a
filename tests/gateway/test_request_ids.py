"""Request ids between tenants, on the real stack (engine and gateway processes on stories260K, two API
keys): the X-Request-Id a client sends is echoed back and logged, never used as the engine's request
id, so a tenant that sends the id of another tenant's running stream is served like any other request
and cannot refuse, abort or cut that stream."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.processes import require_shared, start_engine, start_gateway
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "sk-tenant-a-111", "sk-tenant-b-222"
VICTIM_ID = "victim-stream-1"
LONG = 400  # tokens of A's stream: it is still running when B's requests come


@pytest.fixture(scope="module")
def gateway():
    with start_engine(require_shared(f"models/{MODEL}")) as engine:
        with start_gateway(engine.address, "--api-key", KEY_A, "--api-key", KEY_B) as process:
            yield process


def events(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def headers(key: str, request_id: str = VICTIM_ID) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "X-Request-Id": request_id}


def test_another_tenant_sending_a_running_streams_id_is_served_and_the_stream_finishes(gateway):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=headers(KEY_A)) as victim:
            assert victim.status_code == 200 and victim.headers["x-request-id"] == VICTIM_ID
            victim_events = events(victim.iter_lines())
            first = next(victim_events)

            # B, with A's id: a plain completion is served and its answer echoes B's header.
            plain = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                headers=headers(KEY_B),
            )
            assert plain.status_code == 200, plain.text
            assert plain.headers["x-request-id"] == VICTIM_ID
            assert plain.json()["choices"][0]["finish_reason"] == "length"
            assert plain.json()["id"] != first["id"]  # its own id in the engine, not A's

            # B streams with A's id and closes its stream early: nothing of A's ends with it.
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
            with http.stream(
                "POST", "/v1/chat/completions", json=chat | {"max_tokens": 200}, headers=headers(KEY_B)
            ) as cut:
                assert cut.status_code == 200 and cut.headers["x-request-id"] == VICTIM_ID
                assert next(events(cut.iter_lines()))["id"] != first["id"]

            rest = list(victim_events)
    finishes = [c["finish_reason"] for e in [first, *rest] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert rest[-1]["usage"]["completion_tokens"] == LONG
    assert {e["id"] for e in [first, *rest]} == {first["id"]}


def test_the_same_client_id_on_concurrent_requests_of_one_tenant_is_served_twice(gateway):
    """A client reusing one X-Request-Id for every request (a common default) is never refused."""
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        with (
            http.stream("POST", "/v1/completions", json=body, headers=headers(KEY_A, "same")) as one,
            http.stream("POST", "/v1/completions", json=body, headers=headers(KEY_A, "same")) as two,
        ):
            assert (one.status_code, two.status_code) == (200, 200)
            streams = [list(events(one.iter_lines())), list(events(two.iter_lines()))]
    for stream in streams:
        finishes = [c["finish_reason"] for e in stream for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
        assert sum(1 for e in stream for c in e["choices"] if c["text"]) > 0
    assert streams[0][0]["id"] != streams[1][0]["id"]


def test_messages_echo_the_clients_id_and_answer_the_gateways_as_request_id(gateway):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    replies = []
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        for key in (KEY_A, KEY_B):
            auth = {"x-api-key": key, "anthropic-version": "2023-06-01", "X-Request-Id": VICTIM_ID}
            reply = http.post("/v1/messages", json=body, headers=auth)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-request-id"] == VICTIM_ID
            assert reply.json()["id"] == f"msg_{reply.headers['request-id']}"
            replies.append(reply.headers["request-id"])
    assert len(set(replies)) == 2 and VICTIM_ID not in replies
