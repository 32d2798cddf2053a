"""The pure helpers behind the HTTP responses: SSE chunk encoding and validation errors naming the field."""

from __future__ import annotations

import json

import pytest

from conduit_gateway.http.sse import ChunkEncoder
from conduit_gateway.http.validation import validation_error
from conduit_gateway.schemas.chat import ChatCompletionChunk

pytestmark = pytest.mark.unit


def test_chunk_encoder_builds_valid_chunks():
    usage = {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    choice = {"index": 0, "delta": {"content": 'quote " and \u00e9'}, "logprobs": None, "finish_reason": None}
    for mode, expected_usage in (("none", "absent"), ("final", None), ("running", usage)):
        encoder = ChunkEncoder(
            id="chatcmpl-1", object="chat.completion.chunk", created=7, model="m", usage_mode=mode
        )
        event = encoder.chunk([choice], lambda: usage)
        assert event.startswith("data: ") and event.endswith("\n\n")
        payload = json.loads(event[len("data: ") : -2])
        assert payload.get("usage", "absent") == expected_usage
        assert payload["choices"] == [choice]
        ChatCompletionChunk.model_validate(payload)
    final = json.loads(encoder.usage_chunk(usage)[len("data: ") : -2])
    assert final["choices"] == [] and final["usage"] == usage


def test_validation_error_params():
    union = [{"type": "int_type", "loc": ("body", "prompt", "list[int]", 0), "msg": "bad"}]
    assert validation_error(union).param == "prompt"
    nested = [{"type": "string_type", "loc": ("body", "messages", 2, "content", "str"), "msg": "bad"}]
    assert validation_error(nested).param == "messages[2].content"
    extra = validation_error([{"type": "extra_forbidden", "loc": ("body", "foo"), "msg": "x"}])
    assert (extra.param, extra.message) == ("foo", "Unrecognized request argument supplied: foo")
