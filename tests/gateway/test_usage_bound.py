"""A request's worst case in tokens and what it is charged at its end, prompt by prompt (exact)."""

from __future__ import annotations

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.choices import UsageTotals
from conduit_gateway.handlers.usage_bound import TokenBound

pytestmark = pytest.mark.unit


def text(max_tokens: int | None = None) -> engine_pb2.GenerateRequest:
    request = engine_pb2.GenerateRequest(text="Once upon a time")
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    return request


def test_the_worst_case_counts_every_choice_and_without_max_tokens_the_context():
    bound = TokenBound(n=20)
    bound.plan([text(50)] * 50, context_length=512)
    assert bound.worst() == 50 * 20 * 50
    ids = engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=[1, 2, 3]))
    bound = TokenBound(n=2)
    bound.plan([text(), ids], context_length=512)
    assert bound.worst() == 2 * 512 + 2 * 512  # before the engine counts the prompts
    bound.opened(0, 5)
    assert bound.worst() == 5 + 2 * (512 - 5) + 2 * 512
    bound = TokenBound(n=1)
    bound.plan([text()], context_length=None)
    assert bound.worst() == 0  # nothing known bounds it: only what the engine reports is charged


def test_a_request_is_charged_its_usage_where_it_ended_its_worst_case_where_it_did_not():
    bound = TokenBound(n=2)
    bound.plan([text(100), text(100), text(100)], context_length=512)
    usage = UsageTotals(3)
    for prompt in (0, 1):
        bound.opened(prompt, 5)
    usage.update(0, engine_pb2.Usage(prompt_tokens=5, completion_tokens=30))
    bound.finished(0)
    bound.finished(0)
    usage.update(1, engine_pb2.Usage(prompt_tokens=5, completion_tokens=7))
    bound.finished(1)  # one choice of two: the stream did not end
    # Prompt 0: its usage; prompt 1: opened, not ended: 5 + 2 x 100; prompt 2: never opened: nothing.
    assert bound.used(usage) == 35 + 205


def test_a_prompt_drained_to_its_end_after_the_client_left_is_charged_its_usage():
    bound = TokenBound(n=2)
    bound.plan([text(400), text(400)], context_length=512)
    usage = UsageTotals(2)
    for prompt in (0, 1):
        bound.opened(prompt, 5)
    bound.finished(0)  # one choice of prompt 0 ended before the client left
    assert not bound.done(0)
    usage.update(0, engine_pb2.Usage(prompt_tokens=5, completion_tokens=12))  # the drain's last message
    bound.ended(0)
    assert bound.done(0)
    usage.update(1, engine_pb2.Usage(prompt_tokens=5, completion_tokens=3))  # its drain failed
    assert bound.used(usage) == (5 + 12) + (5 + 2 * 400)
