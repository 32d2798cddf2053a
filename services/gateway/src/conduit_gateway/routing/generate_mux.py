"""Every Generate of one engine channel on one GenerateStream (the gateway's side of it).

As its own Generate call, each token of each request costs the gateway a gRPC read: a future, a callback
from gRPC's poller thread, a reader task's step. On a GenerateStream the engine sends one batch per step
holding that step's message of every request, one task here (`_Session._receive`) reads the batches and
hands each message to its request's `MuxCall`, and the handler reading that call wakes once.

A `MuxCall` reads like the grpc.aio call of Generate (`read()`: each message, then grpc.aio.EOF, or an
AioRpcError with the status the engine ended the request with; `cancel()`), with two differences the
gateway relies on: cancelling a `read()` loses nothing and leaves the call open (no reader task is
needed to protect it), and `take_ready()` hands over what has arrived without waiting. A request's
deadline is kept here (DEADLINE_EXCEEDED, and the engine is told to cancel it). When the stream itself
breaks (the engine died, the channel closed), every request open on it ends with that error, as each
Generate call would have; the next request opens a new stream.

What arrives for a request is held until it is read, however slowly: one slow reader cannot hold up
the others' messages on the shared stream (at most a request's max_tokens messages are held).

A reader may also take the messages as they arrive, without waking (`push_to`): while it waits on its
`read()`, each message it accepts (`Push.accepts`) goes straight to `Push.take` in the receiving task,
and the rest (the one that finishes the request, any the reader is not ready for) arrive by `read()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import grpc

from conduit.engine.v1 import engine_pb2

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_EMPTY = grpc.aio.Metadata()

# Bytes an action in a batch adds around its request (field tags, length prefixes, its tag number), and a
# metadata entry around its key and value, at most.
_ACTION_OVERHEAD = 32
_ENTRY_OVERHEAD = 18

# What a MuxCall ends with: grpc.aio.EOF after its last message, else the exception a read raises.
End = object


class Push(Protocol):
    """Where a reader takes a call's messages as they arrive (MuxCall.push_to)."""

    def accepts(self, message: engine_pb2.GenerateResponse) -> bool:
        """Whether `take` handles `message` now (else `read()` returns it); no side effects."""
        ...

    def take(self, message: engine_pb2.GenerateResponse) -> None:
        """Handle `message` as the reader would once `read()` returned it. An exception is raised by
        the reader's next `read()` (the request stays open until the reader cancels it)."""
        ...


class TokenPush(Push, Protocol):
    """A push that can also take a message that only adds tokens to a choice it has opened, given its token
    ids and text as read once for every layer (`take_tokens`), while `takes_tokens` says so."""

    takes_tokens: bool

    def take_tokens(self, message: engine_pb2.GenerateResponse, token_ids: Sequence[int], text: str) -> None:
        """Handle `message`, one `accepts` took and that only adds `token_ids` and `text`, as `take` would."""
        ...


# A reading layer's step for a message: what its own read would return for it (the same message, maybe
# changed), and the same step for a message that only adds tokens, given its token ids and text.
Relay = Callable[[engine_pb2.GenerateResponse], engine_pb2.GenerateResponse]
TokenRelay = Callable[[engine_pb2.GenerateResponse, Sequence[int], str], None]


class Relayed:
    """`push`, each message it takes passed through `relay` first: a reading layer (a stream over the
    call) pushes what its own read would have returned. Layers over layers make one Relayed whose relays
    run innermost first, as the reads would; while a TokenPush `takes_tokens`, each message goes through
    the layers' token relays and its `take_tokens` instead, its token ids and text read once."""

    __slots__ = ("accepts", "_push", "_relays", "_token_push", "_token_relays")

    def __init__(self, push: Push, relay: Relay, token_relay: TokenRelay) -> None:
        if isinstance(push, Relayed):
            inner, relays, token_relays = push._push, push._relays, push._token_relays
        else:
            inner, relays, token_relays = push, (), ()
        self._push = inner
        self.accepts = inner.accepts
        self._relays: tuple[Relay, ...] = (relay, *relays)
        self._token_relays: tuple[TokenRelay, ...] = (token_relay, *token_relays)
        self._token_push: TokenPush | None = inner if hasattr(inner, "take_tokens") else None  # type: ignore[assignment]

    def take(self, message: engine_pb2.GenerateResponse) -> None:
        push = self._token_push
        if push is not None and push.takes_tokens:
            token_ids, text = message.token_ids, message.text  # each field read builds a wrapper: once
            for token_relay in self._token_relays:
                token_relay(message, token_ids, text)
            push.take_tokens(message, token_ids, text)
            return
        for relay in self._relays:
            message = relay(message)
        self._push.take(message)


# Opens the GenerateStream call on the channel, sending what the iterator yields.
OpenStream = Callable[[AsyncIterator[engine_pb2.GenerateStreamRequest]], grpc.aio.StreamStreamCall]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a Generate call ended with this status would raise."""
    return grpc.aio.AioRpcError(code, _EMPTY, _EMPTY, details)


class MuxCall:
    """One request on a GenerateStream, read like its Generate call would be (see the module's doc)."""

    __slots__ = ("tag", "_session", "_items", "_end", "_waiter", "_timer", "_push", "_push_failed")

    def __init__(self, session: _Session, tag: int) -> None:
        self.tag = tag
        self._session = session
        self._items: deque[engine_pb2.GenerateResponse] = deque()
        self._end: End | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._push: Push | None = None
        self._push_failed: Exception | None = None

    def push_to(self, push: Push | None) -> bool:
        """From now on, while a `read()` waits, each message `push` accepts goes to `push.take` instead
        (None: every message is read again)."""
        self._push = push
        return True

    async def next_item(self) -> engine_pb2.GenerateResponse | End:
        """The next message, else the end: grpc.aio.EOF or the error (returned, not raised)."""
        while True:
            if self._items:
                return self._items.popleft()
            if self._push_failed is not None:
                failed, self._push_failed = self._push_failed, None
                return failed
            if self._end is not None:
                return self._end
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def read(self) -> engine_pb2.GenerateResponse | End:
        """The next message, or grpc.aio.EOF at the end; raises the request's error."""
        item = await self.next_item()
        if isinstance(item, BaseException):
            raise item
        return item

    def take_ready(self) -> list[engine_pb2.GenerateResponse]:
        """The messages that have arrived, without waiting (the end stays for the next read)."""
        if not self._items:
            return []
        items = list(self._items)
        self._items.clear()
        return items

    def cancel(self) -> bool:
        """End the request: the engine is told to cancel it (it aborts the request and frees its blocks),
        and reads raise asyncio.CancelledError from now on, as a cancelled grpc.aio call's do."""
        if self._end is not None:
            return False
        self._items.clear()
        self._push = None
        self._finish(asyncio.CancelledError())
        self._session.cancel(self.tag)
        return True

    def _expire(self) -> None:
        self._timer = None
        if self._end is None:
            self._finish(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._session.cancel(self.tag)

    def deliver(self, message: engine_pb2.GenerateResponse) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            # The reader waits, so it has read everything before this message: a push keeps the order.
            push = self._push
            if push is not None and push.accepts(message):
                try:
                    push.take(message)
                except Exception as exc:
                    self._push, self._push_failed = None, exc
                    waiter.set_result(None)
                return
            self._items.append(message)
            waiter.set_result(None)
            return
        self._items.append(message)

    def _finish(self, end: End) -> None:
        if self._end is not None:
            return
        self._end = end
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        self._finish(rpc_error(code, details))

    def set_deadline(self, timeout_s: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def end(self, code: int, details: str) -> None:
        """The engine ended the request with this status (0: its messages are complete)."""
        status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
        self._finish(grpc.aio.EOF if status is grpc.StatusCode.OK else rpc_error(status, details))


class _Session:
    """One GenerateStream call: the requests open on it and the task that reads its batches."""

    def __init__(
        self,
        open_stream: OpenStream,
        on_end: Callable[[_Session, grpc.aio.AioRpcError | None], None],
        batch_bytes: int = 0,
    ) -> None:
        # What is still to be written, in order. With `batch_bytes` (the engine takes batched actions up
        # to that size) the actions of one moment share one batch, the last one queued (`_batch`), until
        # it is written or full; an action too large to share one goes alone.
        self._outgoing: deque[engine_pb2.GenerateStreamRequest] = deque()
        self._queued = asyncio.Event()
        self._batch_bytes = batch_bytes
        self._batch: engine_pb2.GenerateStreamRequest | None = None
        self._batch_size = 0  # bytes of `_batch`, as estimated
        self.calls: dict[int, MuxCall] = {}
        self._retired = False
        self._on_end = on_end
        self._call = open_stream(self._requests())
        self._task = asyncio.ensure_future(self._receive())

    def open(
        self, tag: int, request: engine_pb2.GenerateRequest, metadata: Sequence[tuple[str, str]]
    ) -> MuxCall:
        call = MuxCall(self, tag)
        self.calls[tag] = call
        size = 0
        if self._batch_bytes:  # its size decides whether it shares a batch
            size = request.ByteSize() + _ACTION_OVERHEAD
            for key, value in metadata:
                size += len(key.encode()) + len(value.encode()) + _ENTRY_OVERHEAD
        action = self._next_action(size)
        action.open.tag = tag
        action.open.request.CopyFrom(request)
        action.open.metadata.update(metadata)
        return call

    def cancel(self, tag: int) -> None:
        if self.calls.pop(tag, None) is not None:
            self._next_action(_ACTION_OVERHEAD).cancel = tag
        self._close_if_retired()

    def _next_action(self, size: int) -> engine_pb2.GenerateStreamRequest:
        """A new action of about `size` bytes, to be filled in now and written in its turn."""
        self._queued.set()
        limit = self._batch_bytes
        if not limit or size > limit // 2:  # no batches, or one this large: alone
            action = engine_pb2.GenerateStreamRequest()
            self._outgoing.append(action)
            self._batch = None
            return action
        if self._batch is None or self._batch_size + size > limit:
            self._batch = engine_pb2.GenerateStreamRequest()
            self._batch_size = _ACTION_OVERHEAD
            self._outgoing.append(self._batch)
        self._batch_size += size
        return self._batch.batch.actions.add()

    def close(self) -> None:
        self._call.cancel()

    def retire(self) -> None:
        """Take no new requests; close once the open ones have ended (a new session takes the others)."""
        self._retired = True
        self._close_if_retired()

    def _close_if_retired(self) -> None:
        if self._retired and not self.calls:
            self.close()

    async def _requests(self) -> AsyncIterator[engine_pb2.GenerateStreamRequest]:
        # Nothing is written before the engine has taken the stream (its initial metadata): a write racing
        # a refusal (UNIMPLEMENTED, UNAUTHENTICATED) can make gRPC report INTERNAL instead.
        await self._call.initial_metadata()
        outgoing = self._outgoing
        while True:
            await self._queued.wait()
            self._queued.clear()
            while outgoing:
                action = outgoing.popleft()
                if action is self._batch:
                    self._batch = None  # what is said from now on goes in a new batch
                yield action

    async def _receive(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        closed = False  # by the gateway (close(), or the app stopping)
        try:
            async for batch in self._call:
                calls = self.calls
                for item in batch.messages:
                    call = calls.get(item.tag)
                    if call is not None:
                        call.deliver(item.message)
                for ended in batch.ends:
                    call = calls.pop(ended.tag, None)
                    if call is not None:
                        call.end(ended.code, ended.details)
                if self._retired and not calls:
                    self.close()
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            closed = True
            raise
        finally:
            self._on_end(self, error)
            calls, self.calls = self.calls, {}
            if closed:
                code, details = grpc.StatusCode.CANCELLED, "the gateway closed the engine's GenerateStream"
            else:
                code, details = _open_calls_status(error)
            for call in calls.values():
                call.fail(code, details)


# Statuses of the whole stream that say something of the caller, passed on to each request open on it.
_CALLER_STATUSES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def _open_calls_status(error: grpc.aio.AioRpcError | None) -> tuple[grpc.StatusCode, str]:
    """What each request open on a stream that ended gets. The engine ends a request with its own status
    (an end item), never the stream, so a stream that ends or fails otherwise has lost its engine, as a
    broken Generate call has: UNAVAILABLE (retried elsewhere before a first message, migrated after),
    whatever gRPC reported (a write racing the connection's end shows as INTERNAL, a stopping server as
    CANCELLED); refusals of the caller stay themselves."""
    if error is None:
        return grpc.StatusCode.UNAVAILABLE, "the engine ended its GenerateStream"
    code = error.code()
    if code in _CALLER_STATUSES:
        return code, error.details() or ""
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return grpc.StatusCode.UNAVAILABLE, f"GenerateStream is not served: {error.details()}"
    return grpc.StatusCode.UNAVAILABLE, f"the engine's GenerateStream broke ({code.name}: {error.details()})"


class GenerateMux:
    """The GenerateStream of one channel, opened on the first request and again after it ends.

    `on_unimplemented` is told when the engine answers that it does not serve GenerateStream after all
    (something between gateway and engine that passes only known methods): the requests open on it end
    UNAVAILABLE (retried elsewhere, like a refusal), and the caller stops multiplexing."""

    def __init__(
        self,
        open_stream: OpenStream,
        on_unimplemented: Callable[[], None] = lambda: None,
        batch_bytes: int = 0,
    ) -> None:
        self._open_stream = open_stream
        self._on_unimplemented = on_unimplemented
        # The largest batch of actions the engine takes (GetModelInfo's generate_stream_batch_bytes).
        self.batch_bytes = batch_bytes
        self._session: _Session | None = None
        self._next_tag = 1

    @property
    def open_calls(self) -> int:
        return len(self._session.calls) if self._session is not None else 0

    def generate(
        self,
        request: engine_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, str]],
        timeout_s: float | None,
    ) -> MuxCall:
        """Start `request` as a Generate call with these metadata and deadline would."""
        if self._session is None:
            self._session = _Session(self._open_stream, self._ended, self.batch_bytes)
        tag = self._next_tag
        self._next_tag += 1
        call = self._session.open(tag, request, metadata)
        if timeout_s is not None:
            call.set_deadline(timeout_s)
        return call

    def renew(self) -> None:
        """The next request opens a new stream (with the call metadata of now: a new engine token); the
        current one closes once the requests open on it have ended."""
        if self._session is not None:
            session, self._session = self._session, None
            session.retire()

    def _ended(self, session: _Session, error: grpc.aio.AioRpcError | None) -> None:
        if self._session is session:
            self._session = None
        if error is not None and error.code() is grpc.StatusCode.UNIMPLEMENTED:
            log.warning(
                "GenerateStream is not served there (%s): one Generate call per prompt from now on",
                error.details(),
            )
            self._on_unimplemented()

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
