"""An engine whose drain runs out hands its streams back (FINISH_REASON_MIGRATE): with no other engine to
continue them on, the client sees the error event of an engine gone mid-stream, never a short output that
claims to have finished. Real engine and gateway processes (tests/migration: with other engines)."""

from __future__ import annotations

import signal

import openai
import pytest

from tests.routing.helpers import MODEL, sdk
from tests.support.processes import require_shared, start_engine, start_gateway

pytestmark = pytest.mark.integration


def test_a_stream_handed_back_by_a_draining_engine_ends_with_an_error_event():
    model = require_shared(f"models/{MODEL}")
    with start_engine(model, "--drain-seconds", "0") as engine, start_gateway([engine.address]) as gateway:
        with sdk(gateway.url) as client:
            stream = client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=480,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finish_reasons = []
            with pytest.raises(openai.APIError) as caught:
                for index, chunk in enumerate(stream):
                    if index == 0:
                        engine.process.send_signal(signal.SIGTERM)
                    finish_reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert finish_reasons == []
    assert caught.value.body == {
        "message": caught.value.message,
        "type": "server_error",
        "param": None,
        "code": "engine_unavailable",
    }
