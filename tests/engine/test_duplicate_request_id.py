"""A gRPC client that sends the request_id of another caller's running request, through a real engine
server on stories260K: the duplicate is refused, and neither the refusal nor the duplicate call's
closing ends the request that owns the id.

To hold the owner running while the duplicate arrives (whatever the machine's speed), the engine's
steps are paused: the loop thread still applies admissions and aborts, it only stops producing tokens.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from conduit.engine.v1 import engine_pb2 as pb
from tests.engine.support.server_thread import ServerThread, engine_config, wait_until
from tests.support.stories import PROMPT

pytestmark = pytest.mark.integration

MAX_TOKENS = 48


@contextmanager
def steps_paused(server: ServerThread) -> Iterator[None]:
    """While inside, the engine's steps produce nothing (its loop thread goes on applying commands)."""
    core = server.server.async_engine.core
    step = core.step
    resume = threading.Event()

    def paused_step():
        if resume.is_set():
            return step()
        resume.wait(timeout=0.01)
        return []

    core.step = paused_step
    try:
        yield
    finally:
        resume.set()
        del core.step  # the class's own step again


@pytest.fixture(scope="module")
def server(stories_path):
    srv = ServerThread(engine_config(stories_path)).start()
    yield srv
    srv.stop()


def on_engine_thread(server: ServerThread, fn=lambda: None):
    """Run `fn` on the engine's loop thread after every command submitted before (a barrier)."""
    async_engine = server.server.async_engine
    return asyncio.run_coroutine_threadsafe(async_engine.run_sync(fn), server.loop).result(30)


def request(request_id: str, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, text=PROMPT, sampling=sampling)


def test_a_duplicate_request_id_is_refused_and_closing_it_leaves_the_owner_running(server):
    stub = server.stub()
    core = server.server.async_engine.core
    owner = stub.Generate(request("shared-id"))
    first = next(owner)
    assert first.request_id == "shared-id" and not first.finished
    with steps_paused(server):
        duplicate = stub.Generate(request("shared-id", max_tokens=4))
        with pytest.raises(grpc.RpcError) as refused:
            next(duplicate)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in refused.value.details() and "already running" in refused.value.details()
        duplicate.cancel()  # the refused caller closes its call
        on_engine_thread(server)  # whatever the refusal queued on the engine thread has run
        assert on_engine_thread(server, lambda: core.has_request("shared-id"))
    rest = list(owner)
    final = rest[-1]
    assert final.finished and final.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == MAX_TOKENS
    assert final.usage.completion_tokens == MAX_TOKENS
    # The id is free again once its owner finished: anyone may use it now.
    again = list(stub.Generate(request("shared-id", max_tokens=4)))
    assert again[-1].finish_reason == pb.FINISH_REASON_LENGTH
    server.check_integrity()


def test_a_duplicate_whose_caller_leaves_before_its_admission_ends_nothing(server):
    """The duplicate's caller cancels while its admission still waits in the engine's command queue."""
    stub = server.stub()
    async_engine = server.server.async_engine
    owner = stub.Generate(request("queued-id"))
    first = next(owner)
    holding, held = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        held.wait(timeout=60)

    with steps_paused(server):
        try:
            async_engine.call_soon(hold)  # holds the loop thread
            assert holding.wait(timeout=30)
            duplicate = stub.Generate(request("queued-id", max_tokens=4))
            # The duplicate's admission is queued behind the held command; then its caller leaves.
            assert wait_until(lambda: async_engine.pending_commands >= 1)
            duplicate.cancel()
            assert wait_until(lambda: async_engine.pending_commands >= 2)  # its abort, queued too
        finally:
            held.set()
        on_engine_thread(server)
        assert on_engine_thread(server, lambda: async_engine.core.has_request("queued-id"))
    rest = list(owner)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == MAX_TOKENS
    server.check_integrity()
