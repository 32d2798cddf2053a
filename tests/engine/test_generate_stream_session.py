"""The GenerateStream session's batching on its own (entrypoints/generate_stream.py): what several requests'
generators produce between two batches goes out in one, each request's messages in order and its end after
them; a batch is cut before it passes BATCH_SOFT_BYTES of prompt-logprob messages; a request's error ends
only its tag, with the status `status_for` gives. The requests here are plain generators (the real engine's
are covered by tests/gateway/test_generate_stream.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.entrypoints import generate_stream
from conduit_engine.entrypoints.generate_stream import GenerateStreamSession
from conduit_engine.errors import InvalidRequestError

pytestmark = pytest.mark.unit


def _status(exc: BaseException) -> grpc.StatusCode:
    return (
        grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, InvalidRequestError) else grpc.StatusCode.INTERNAL
    )


async def _run(
    generate, actions: list[pb.GenerateStreamRequest]
) -> tuple[list[pb.GenerateStreamBatch], dict[int, list[pb.GenerateResponse]], dict[int, tuple[int, str]]]:
    async def requests() -> AsyncIterator[pb.GenerateStreamRequest]:
        for action in actions:
            yield action

    batches = [batch async for batch in GenerateStreamSession(generate, _status).run(requests())]
    messages: dict[int, list[pb.GenerateResponse]] = {}
    ends: dict[int, tuple[int, str]] = {}
    for batch in batches:
        for item in batch.messages:
            assert item.tag not in ends, "a message after its end"
            messages.setdefault(item.tag, []).append(item.message)
        for end in batch.ends:
            ends[end.tag] = (end.code, end.details)
    return batches, messages, ends


def _open(tag: int, tokens: int, prompt_logprobs: int = 0) -> pb.GenerateStreamRequest:
    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(max_tokens=tokens, prompt_logprobs=prompt_logprobs)
    )
    return pb.GenerateStreamRequest(open=pb.GenerateStreamOpen(tag=tag, request=request))


async def _steps(
    request: pb.GenerateRequest, metadata: Sequence[tuple[str, str]]
) -> AsyncIterator[pb.GenerateResponse]:
    """One message per 'step' (a yield to the loop), as a request in the engine gets one per step."""
    for step in range(request.sampling.max_tokens):
        message = pb.GenerateResponse(token_ids=[step], finished=step == request.sampling.max_tokens - 1)
        if step == 0 and request.sampling.prompt_logprobs:
            entry = pb.PositionLogprobs(token=pb.TokenLogprob(token_id=1, text="x" * 1000, logprob=-1.0))
            message.prompt_logprobs.extend([entry] * request.sampling.prompt_logprobs)
        yield message
        await asyncio.sleep(0)


def test_each_step_of_every_request_goes_out_in_one_batch_in_order_and_ends_after():
    batches, messages, ends = asyncio.run(_run(_steps, [_open(1, 5), _open(2, 5), _open(3, 3)]))
    assert {tag: [list(m.token_ids) for m in got] for tag, got in messages.items()} == {
        1: [[0], [1], [2], [3], [4]],
        2: [[0], [1], [2], [3], [4]],
        3: [[0], [1], [2]],
    }
    assert ends == {1: (0, ""), 2: (0, ""), 3: (0, "")}
    assert len(batches) < sum(len(got) for got in messages.values())  # steps were shared


def test_a_batch_is_cut_before_it_passes_the_bytes_of_prompt_logprobs(monkeypatch):
    monkeypatch.setattr(generate_stream, "BATCH_SOFT_BYTES", 50_000)
    # Four requests whose first message carries about 40 KB of prompt logprobs each.
    batches, messages, ends = asyncio.run(
        _run(_steps, [_open(tag, 2, prompt_logprobs=40) for tag in range(4)])
    )
    assert all(len(got) == 2 for got in messages.values()) and len(ends) == 4
    for batch in batches:
        large = [item for item in batch.messages if item.message.prompt_logprobs]
        assert len(large) <= 1  # 2 x 40 KB is past 50 KB: each went in a batch of its own


def test_a_failing_request_ends_its_own_tag_and_the_others_go_on():
    async def generate(request, metadata):
        if request.sampling.max_tokens == 2:
            yield pb.GenerateResponse(token_ids=[7])
            raise InvalidRequestError("temperature", "must be >= 0")
        if request.sampling.max_tokens == 3:
            raise RuntimeError("a bug")
        async for message in _steps(request, metadata):
            yield message

    _, messages, ends = asyncio.run(_run(generate, [_open(1, 4), _open(2, 2), _open(3, 3)]))
    assert ends[1] == (0, "")
    assert ends[2][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "temperature" in ends[2][1]
    assert [list(m.token_ids) for m in messages[2]] == [[7]]  # what came before the error went out first
    assert ends[3] == (grpc.StatusCode.INTERNAL.value[0], generate_stream.INTERNAL_DETAILS)
    assert 3 not in messages


def _held_after_one(started: asyncio.Event):
    """Generate where a request of 1000 tokens sends one message, sets `started` and waits to be
    cancelled; the others step as `_steps`."""

    async def generate(request, metadata):
        if request.sampling.max_tokens == 1000:
            yield pb.GenerateResponse(token_ids=[0])
            started.set()
            await asyncio.sleep(3600)  # cancelled long before
        async for message in _steps(request, metadata):
            yield message

    return generate


def test_a_cancelled_tag_sends_nothing_more_and_no_end():
    started = asyncio.Event()
    generate = _held_after_one(started)

    async def main():
        async def requests():
            yield _open(1, 1000)
            await started.wait()
            yield pb.GenerateStreamRequest(cancel=1)
            yield _open(2, 3)

        session = GenerateStreamSession(generate, _status)
        return [batch async for batch in session.run(requests())]

    batches = asyncio.run(main())
    tags = [item.tag for batch in batches for item in batch.messages]
    ends = [end.tag for batch in batches for end in batch.ends]
    assert tags.count(1) == 1 and ends == [2]


def _batch(*actions: pb.GenerateStreamRequest) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(batch=pb.GenerateStreamActions(actions=actions))


def test_a_batch_of_actions_is_applied_in_its_order():
    started = asyncio.Event()
    generate = _held_after_one(started)

    async def main():
        async def requests():
            yield _batch(_open(1, 1000), _open(2, 2))
            await started.wait()
            # A cancel of a request opened in the same batch comes after its open: it is cancelled.
            yield _batch(pb.GenerateStreamRequest(cancel=1), _open(3, 2), pb.GenerateStreamRequest(cancel=3))
            yield _batch(_open(4, 3))

        session = GenerateStreamSession(generate, _status)
        return [batch async for batch in session.run(requests())]

    batches = asyncio.run(main())
    tags = [item.tag for batch in batches for item in batch.messages]
    ends = {end.tag for batch in batches for end in batch.ends}
    assert tags.count(1) == 1 and tags.count(2) == 2 and tags.count(4) == 3
    assert ends == {2, 4}  # 1 and 3 were cancelled: no end of theirs


def test_a_batch_inside_a_batch_ends_the_stream_as_a_protocol_error():
    with pytest.raises(generate_stream.ProtocolError, match="a batch inside a batch"):
        asyncio.run(_run(_steps, [_batch(_open(1, 2), _batch(_open(2, 2)))]))
