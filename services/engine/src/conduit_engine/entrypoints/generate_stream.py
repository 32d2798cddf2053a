"""GenerateStream: many Generate calls carried on one gRPC stream, answered in batches.

A gateway that streams hundreds of requests from one engine pays gRPC's per-message cost (a read, a
callback from its poller thread, a task step) for every token of every request when each request is its
own Generate call. On one GenerateStream the client opens requests under tags of its own and cancels
them by tag; each open request runs exactly as a Generate call would (`Generate` below is the same
generator), and its messages go into the session's outbox instead of their own call. The writer sends
everything the outbox holds as one `GenerateStreamBatch`: what the requests' tasks put there since the
last batch, which after an engine step is that step's message of every request on the stream.

Each request ends with the status its Generate call would have ended with (`status_for`), so the client
can raise the same errors. Closing the stream (the client went away, or the engine stops) cancels every
request still open on it, which aborts them in the engine as a cancelled Generate does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.errors import EngineError

log = logging.getLogger(__name__)

# Generate of one request: (request, its call metadata) → its messages; raises what Generate raises.
GenerateFn = Callable[[pb.GenerateRequest, Sequence[tuple[str, str]]], AsyncIterator[pb.GenerateResponse]]
# The status an exception of GenerateFn travels as.
StatusFor = Callable[[BaseException], grpc.StatusCode]

# Why the stream's caller may not start a request now (None: it may): the engine's token, checked at
# each open as it is at the start of each Generate call, so a token rotated since the stream opened
# refuses the stream's new requests while its running ones finish.
Authorize = Callable[[], str | None]

# A batch is cut before it grows past this many bytes of messages that carry prompt logprobs (the only
# ones that can be large): far below the message size limit, whatever the requests ask for.
BATCH_SOFT_BYTES = 4 * 1024 * 1024
INTERNAL_DETAILS = "internal error in the engine (details are in its log)"


class GenerateStreamSession:
    """One GenerateStream call: a task per open request, the outbox they fill and the batches it makes."""

    def __init__(
        self, generate: GenerateFn, status_for: StatusFor, authorize: Authorize | None = None
    ) -> None:
        self._generate = generate
        self._status_for = status_for
        self._authorize = authorize
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._messages: list[tuple[int, pb.GenerateResponse]] = []
        self._ends: list[pb.GenerateStreamEnd] = []
        self._wake = asyncio.Event()
        self._requests_done = False
        self._protocol_error: str | None = None

    async def run(
        self, requests: AsyncIterator[pb.GenerateStreamRequest]
    ) -> AsyncIterator[pb.GenerateStreamBatch]:
        """The batches of the stream, until the client has closed its side and every request ended."""
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._protocol_error is not None:
                    raise ProtocolError(self._protocol_error)
                while self._messages or self._ends:
                    yield self._next_batch()
                if self._requests_done and not self._tasks:
                    return
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()

    def _next_batch(self) -> pb.GenerateStreamBatch:
        """What the outbox holds, up to BATCH_SOFT_BYTES of large messages; the ends once every message
        before them went out."""
        batch = pb.GenerateStreamBatch()
        messages = self._messages
        large = 0
        taken = len(messages)
        for index, (tag, message) in enumerate(messages):
            if message.prompt_logprobs:
                large += message.ByteSize()
                if large > BATCH_SOFT_BYTES and index > 0:
                    taken = index
                    break
            item = batch.messages.add()
            item.tag = tag
            item.message.CopyFrom(message)
        if taken == len(messages):
            self._messages = []
            batch.ends.extend(self._ends)
            self._ends = []
        else:
            self._messages = messages[taken:]
        return batch

    async def _read(self, requests: AsyncIterator[pb.GenerateStreamRequest]) -> None:
        try:
            async for action in requests:
                if action.WhichOneof("action") == "batch":
                    for each in action.batch.actions:
                        if each.WhichOneof("action") == "batch":
                            self._refuse("GenerateStream: a batch inside a batch")
                            return
                        self._apply(each)
                else:
                    self._apply(action)
        finally:
            self._requests_done = True
            self._wake.set()

    def _apply(self, action: pb.GenerateStreamRequest) -> None:
        kind = action.WhichOneof("action")
        if kind == "open":
            self._open(action.open)
        elif kind == "cancel":
            task = self._tasks.pop(action.cancel, None)
            if task is not None:
                task.cancel()

    def _refuse(self, problem: str) -> None:
        """The client broke the protocol: the stream ends INVALID_ARGUMENT (ProtocolError)."""
        self._protocol_error = problem
        self._wake.set()

    def _open(self, opened: pb.GenerateStreamOpen) -> None:
        tag = opened.tag
        if tag in self._tasks:
            self._refuse(f"GenerateStream: tag {tag} is already open")
            return
        problem = self._authorize() if self._authorize is not None else None
        if problem is not None:
            log.warning("refused a GenerateStream request: %s", problem)
            self._end(tag, grpc.StatusCode.UNAUTHENTICATED, problem)
            return
        metadata = tuple(opened.metadata.items())
        self._tasks[tag] = asyncio.ensure_future(self._serve(tag, opened.request, metadata))

    async def _serve(
        self, tag: int, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str]]
    ) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            async for message in self._generate(request, metadata):
                self._messages.append((tag, message))
                self._wake.set()
        except asyncio.CancelledError:
            return  # cancelled by the client (its end is its own doing) or with the whole stream
        except (EngineError, ValueError) as exc:
            code, details = self._status_for(exc), str(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("internal error in a GenerateStream request")
        except Exception:
            log.exception("unexpected error in a GenerateStream request")
            code, details = grpc.StatusCode.INTERNAL, INTERNAL_DETAILS
        finally:
            if self._tasks.get(tag) is asyncio.current_task():
                del self._tasks[tag]
        self._end(tag, code, details)

    def _end(self, tag: int, code: grpc.StatusCode, details: str) -> None:
        self._ends.append(pb.GenerateStreamEnd(tag=tag, code=code.value[0], details=details))
        self._wake.set()


class ProtocolError(Exception):
    """The client broke the rules of GenerateStream (a tag opened twice): the stream ends INVALID_ARGUMENT."""
