"""Opening the engine streams of one HTTP request and reading them as one sequence of messages.

A stream counts as open once its first message has arrived, so that errors the engine raises before any
output (bad parameters, queue full, not ready) become the HTTP status of the response rather than an
event inside a 200 stream. UNAVAILABLE before the first message is retried on another ready engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from conduit.engine.v1 import engine_pb2
from conduit_gateway.engine.client import EngineClient
from conduit_gateway.engine.pool import EnginePool
from conduit_gateway.errors import OpenAIError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PromptStream:
    """The live gRPC stream of one prompt, with its already-received first message."""

    prompt_index: int
    engine: EngineClient
    call: grpc.aio.UnaryStreamCall
    first: engine_pb2.GenerateResponse

    def cancel(self) -> None:
        # Cancelling the call makes the engine see CANCELLED and free the request's blocks.
        self.call.cancel()


async def open_stream(
    pool: EnginePool,
    model: str,
    prompt_index: int,
    request: engine_pb2.GenerateRequest,
    timeout_s: float | None,
) -> PromptStream:
    """Send `request` to a ready engine for `model` and wait for its first message."""
    tried: list[EngineClient] = []
    metadata = (("x-request-id", request.request_id),)
    while True:
        engine = await pool.acquire(model, exclude=tried)
        call = engine.generate(request, metadata, timeout_s)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            pool.mark_unavailable(engine)
            tried.append(engine)
            if len(tried) >= len(pool.engines):
                raise
            log.warning("engine %s unavailable for %s, trying another", engine.address, request.request_id)
            continue
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise OpenAIError(
                502,
                "the engine ended the stream without any output",
                type="server_error",
                code="engine_error",
            )
        return PromptStream(prompt_index, engine, call, first)


async def open_streams(
    pool: EnginePool,
    model: str,
    requests: Sequence[engine_pb2.GenerateRequest],
    timeout_s: float | None,
) -> list[PromptStream]:
    """Open one stream per prompt concurrently; if any fails, cancel the others and raise its error."""
    if len(requests) == 1:
        return [await open_stream(pool, model, 0, requests[0], timeout_s)]
    tasks = [
        asyncio.create_task(open_stream(pool, model, index, request, timeout_s))
        for index, request in enumerate(requests)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, PromptStream):
                result.cancel()
        raise


async def read_messages(
    streams: Sequence[PromptStream],
) -> AsyncIterator[tuple[int, engine_pb2.GenerateResponse]]:
    """Yield (prompt index, message) as messages arrive, first messages first, until every stream ends.

    An engine error on any stream propagates (as grpc.aio.AioRpcError); the caller cancels the streams.
    """
    for stream in streams:
        yield stream.prompt_index, stream.first
    if len(streams) == 1:
        # The common case needs no queue: read straight from the call as tokens arrive.
        stream = streams[0]
        while (message := await stream.call.read()) is not grpc.aio.EOF:
            yield stream.prompt_index, message
        return
    queue: asyncio.Queue[tuple[int, engine_pb2.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(stream: PromptStream) -> None:
        try:
            while (message := await stream.call.read()) is not grpc.aio.EOF:
                queue.put_nowait((stream.prompt_index, message))
            queue.put_nowait((stream.prompt_index, None))
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait((stream.prompt_index, exc))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(streams)
        while remaining:
            prompt_index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield prompt_index, item
    finally:
        for task in tasks:
            task.cancel()


def cancel_all(streams: Sequence[PromptStream]) -> None:
    for stream in streams:
        stream.cancel()
