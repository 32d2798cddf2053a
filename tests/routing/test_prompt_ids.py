"""What kv_aware sends for a prompt routing has tokenized: the ids in place of the text, nothing else."""

from __future__ import annotations

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.streams import prompt_as_token_ids

pytestmark = pytest.mark.unit


def _request(**fields) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id="r1", sampling=engine_pb2.SamplingParams(max_tokens=7, temperature=0), **fields
    )


def test_a_tokenized_text_prompt_is_sent_as_its_ids_and_the_callers_request_is_unchanged():
    request = _request(text="Once upon a time")
    sent = prompt_as_token_ids(request, (1, 9038, 2501, 263, 931))
    assert sent.WhichOneof("input") == "token_ids" and list(sent.token_ids.ids) == [1, 9038, 2501, 263, 931]
    expected = _request(token_ids=engine_pb2.TokenIds(ids=[1, 9038, 2501, 263, 931]))
    assert sent == expected  # every other field as it was
    assert request.WhichOneof("input") == "text" and request.text == "Once upon a time"


@pytest.mark.parametrize(
    ("request_fields", "token_ids"),
    [
        ({"text": "Once"}, None),  # not tokenized (another strategy, or Tokenize failed)
        ({"text": ""}, (1,)),  # empty text: the engine's own error
        (
            {"chat": engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content="hi")])},
            (1, 2),
        ),
        ({"token_ids": engine_pb2.TokenIds(ids=[5, 6])}, (5, 6)),
    ],
)
def test_other_prompts_are_sent_as_they_are(request_fields, token_ids):
    request = _request(**request_fields)
    assert prompt_as_token_ids(request, token_ids) is request
