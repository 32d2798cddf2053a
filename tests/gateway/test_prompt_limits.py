"""The gateway's prompt size rules (prompt_limits.py) over the engines it knows: the loosest engine of a
model decides, an engine without a bound turns them off, and the body limit of each route follows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import OpenAIError
from conduit_gateway.prompt_limits import BODY_HEADROOM_BYTES, MAX_PROMPTS, body_limit, prompt_limit

pytestmark = pytest.mark.unit

CONFIGURED = 8 * 1024 * 1024


def pool(*engines: tuple[str, int, int]) -> SimpleNamespace:
    """A pool of engines given as (model, max_prompt_bytes, max_model_len)."""
    nodes = [
        SimpleNamespace(
            model=model,
            model_info=engine_pb2.GetModelInfoResponse(
                model=model, max_prompt_bytes=max_bytes, max_model_len=context
            ),
        )
        for model, max_bytes, context in engines
    ]
    return SimpleNamespace(engines=nodes)


def test_the_loosest_engine_of_the_model_decides():
    limit = prompt_limit(pool(("m", 4608, 512), ("m", 9216, 1024), ("other", 100, 10)), "m")
    assert limit is not None and (limit.max_bytes, limit.max_model_len) == (9216, 1024)
    limit.check_texts("prompt", ["x" * 9216])
    with pytest.raises(OpenAIError) as caught:
        limit.check_texts("prompt", ["x" * 9000, "y" * 217])
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert caught.value.message.startswith("prompt: prompt is 9217 bytes of text, more than the 9216 bytes")


def test_an_engine_without_a_bound_turns_the_check_off():
    assert prompt_limit(pool(("m", 4608, 512), ("m", 0, 512)), "m") is None
    assert prompt_limit(pool(("m", 4608, 512)), "unknown") is None


def test_chat_counts_every_message_and_token_arrays_the_context():
    limit = prompt_limit(pool(("m", 100, 10)), "m")
    assert limit is not None
    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content="x" * 60)] * 2)
    with pytest.raises(OpenAIError) as caught:
        limit.check_generate("messages", engine_pb2.GenerateRequest(chat=chat))
    assert caught.value.param == "messages"
    limit.check_generate("prompt", engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=[1] * 9)))
    with pytest.raises(OpenAIError) as caught:
        limit.check_generate(
            "prompt", engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=[1] * 10))
        )
    assert caught.value.message.startswith("prompt: prompt has 10 tokens; the model's context is 10 tokens")


def test_the_body_limit_of_each_route_follows_the_bound():
    engines = pool(("m", 4608, 512))
    one_context = 6 * 4608 + BODY_HEADROOM_BYTES
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/tokenize"):
        assert body_limit(path, CONFIGURED, engines) == one_context
    assert body_limit("/v1/completions", CONFIGURED, engines) == CONFIGURED  # 2048 prompts may fit
    assert (
        body_limit("/v1/completions", 100 * CONFIGURED, engines)
        == MAX_PROMPTS * 6 * 4608 + BODY_HEADROOM_BYTES
    )
    assert body_limit("/detokenize", CONFIGURED, engines) == CONFIGURED
    assert body_limit("/v1/chat/completions", CONFIGURED, pool(("m", 0, 512))) == CONFIGURED
    assert body_limit("/v1/chat/completions", CONFIGURED, pool()) == CONFIGURED
