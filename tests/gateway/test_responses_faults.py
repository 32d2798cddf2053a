"""Responses under injected engine faults (the scriptable fake engine behind the real gateway app): a
background response cancelled mid-generation, an engine failing mid-stream, and an engine refusing a
background request before any output."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from tests.gateway.conftest import MODEL
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration


def test_cancel_mid_generation_keeps_the_text_so_far_and_cancels_the_engine_stream(client, fake):
    fake.script.hold_after = 3  # three tokens, then the engine holds the stream
    queued = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=10)
    events = client.responses.retrieve(queued.id, stream=True)
    seen = []
    for event in events:
        seen.append(event.type)
        if seen.count("response.output_text.delta") == 3:
            break
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    (message,) = cancelled.output
    assert message.status == "incomplete" and message.content[0].text == "Once upon a"
    assert cancelled.usage.output_tokens == 3
    rest = [event.type for event in events]
    assert rest[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    wait_for(lambda: fake.record.cancelled == 1, "the engine stream to be cancelled")


def test_an_engine_failing_mid_stream_fails_the_response(client, http, fake):
    fake.script.error_after = 2
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=10, stream=True))
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.error.code == "engine_error" and failed.output_text == "Once upon"
    assert client.responses.retrieve(failed.id).status == "failed"
    reply = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 10})
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "engine_error"


def test_a_background_request_the_engine_refuses_is_recorded_as_failed(client, fake):
    fake.script.error_before = grpc.StatusCode.INVALID_ARGUMENT
    fake.script.error_message = "temperature: must be <= 2, got 9.0"
    queued = client.responses.create(model=MODEL, input="Hi", background=True, temperature=9)
    events = list(client.responses.retrieve(queued.id, stream=True))
    assert [event.type for event in events] == ["response.queued", "response.in_progress", "response.failed"]
    failed = client.responses.retrieve(queued.id)
    assert failed.status == "failed"
    assert failed.error.code == "invalid_request_error" and failed.error.message.startswith("temperature:")


def test_a_client_leaving_a_stored_stream_cancels_the_response_and_its_engine_stream(client, gateway, fake):
    fake.script.hold_after = 2
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 10, "stream": True}
    with (
        httpx.Client(base_url=gateway.url, timeout=30) as raw,
        raw.stream("POST", "/v1/responses", json=body) as reply,
    ):
        lines = reply.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        deltas = 0
        for line in lines:
            deltas += line.startswith("data: ") and '"response.output_text.delta"' in line
            if deltas == 2:
                break
    response_id = created["response"]["id"]
    wait_for(
        lambda: client.responses.retrieve(response_id).status == "cancelled", "the record to say cancelled"
    )
    assert client.responses.retrieve(response_id).output_text == "Once upon"
    wait_for(lambda: fake.record.cancelled == 1, "the engine stream to be cancelled")
