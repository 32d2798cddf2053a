"""Opening the engine streams of one HTTP request and reading them as one sequence of messages.

A stream counts as open once its first message has arrived, so that errors the engine raises before any
output (bad parameters, queue full, not ready) become the HTTP status of the response rather than an
event inside a 200 stream. A refusal before the first message (UNAVAILABLE: the engine is down or
draining; RESOURCE_EXHAUSTED: its queue is full) is retried on another engine, `config.retries` times at
most; once output has reached the client a request is not retried but migrated: handlers/migration.py
continues its choices on another engine.

`EngineStream` is what the shared flow reads: a `PromptStream` (one engine), or a disaggregated stream
(handlers/disaggregated.py: a prefill engine, then a decode engine) that reads the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from prometheus_client import Histogram

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import OpenAIError
from conduit_gateway.handlers.token_gaps import TokenGaps
from conduit_gateway.http.sse import ClientPace
from conduit_gateway.http.tracing import engine_trace_metadata
from conduit_gateway.routing.client import MessageSource
from conduit_gateway.routing.generate_mux import Push, Relayed
from conduit_gateway.routing.node import EngineNode
from conduit_gateway.routing.pool import EnginePool
from conduit_gateway.routing.roles import NodeRole

log = logging.getLogger(__name__)

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

# How long the Abort RPC of a stream the client left may take.
ABORT_TIMEOUT_S = 1.0


# Told the status of each refusal that is retried on another node (for metrics).
OnRetry = Callable[[grpc.StatusCode], None]


class StreamLost(OpenAIError):
    """The node of an open stream was lost (its health watch broke, or another stream on it did): the call
    was cancelled. The stream moves elsewhere (handlers/migration.py), or the client gets this error."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(
            503,
            f"The engine became unavailable while generating ({reason}).",
            type="server_error",
            code="engine_unavailable",
        )
        self.address = address
        self.reason = reason


class EngineStream(Protocol):
    """One prompt's messages, its first one already received."""

    @property
    def prompt_index(self) -> int: ...

    @property
    def first(self) -> engine_pb2.GenerateResponse: ...

    async def read(self) -> engine_pb2.GenerateResponse | None:
        """The next message, or None at the end; engine errors propagate (AioRpcError). Cancelling a
        read loses nothing: the next read returns the message it was waiting for."""
        ...

    def ready(self) -> list[engine_pb2.GenerateResponse]:
        """The messages that have arrived and can be read without waiting, in order (maybe none); the
        end of the stream and errors are left for the next `read`."""
        ...

    def push_to(self, push: Push | None) -> bool:
        """While a `read` waits, hand each message `push` accepts to `push.take` as it arrives, instead of
        waking the reader (routing/generate_mux.py); None: stop. False when this stream cannot (its
        messages are only read)."""
        ...

    async def abort(self) -> None:
        """Stop the prompt's request on the engine serving it now (its Abort RPC): the stream then ends,
        each unfinished choice with an ABORT message that carries the final usage, and never moves to
        another engine. Raises when the engine cannot be told (AioRpcError, or the stream is closed)."""
        ...

    def close(self) -> None:
        """Cancel what is still open and give back the nodes' slots; safe to call more than once."""
        ...


# Opens one prompt's stream: (prompt index, request) → an open stream.
OpenOne = Callable[[int, engine_pb2.GenerateRequest], Awaitable[EngineStream]]

# Told of a prompt whose opening the client left (open_stream's caller was cancelled after the engine
# had the request): the task that finishes the opening, giving the stream to drain, or None.
OnLeftOpening = Callable[["asyncio.Task[PromptStream | None]"], None]

# How long a prompt left while opening may take to answer its Abort with a first message.
LATE_OPEN_TIMEOUT_S = 2.0


@dataclass(slots=True, eq=False)  # eq=False: hashable, for the node's lost watchers
class PromptStream:
    """The live gRPC stream of one prompt on one node, with its already-received first message.

    It holds one of the node's in-flight slots until `close()`.
    """

    prompt_index: int
    pool: EnginePool
    node: EngineNode
    call: MessageSource  # read so that cancelling a read never cancels the call (`read` below)
    first: engine_pb2.GenerateResponse
    opened_at: float = field(default_factory=time.perf_counter)
    tokens_after_first: int = 0
    closed: bool = False
    blocks: int = 0  # the prompt's KV blocks, counted in the node's active blocks until close()
    # Observes the time between consecutive token messages of each choice (its inter-token latency).
    token_gaps: Histogram | None = None
    _gaps: TokenGaps | None = field(default=None, init=False)  # token_gaps' counts, added in batches
    _last_token_at: dict[int, float] = field(default_factory=dict, init=False)
    lost: str | None = field(default=None, init=False)  # why the node was lost while this was open

    def __post_init__(self) -> None:
        self._last_token_at[self.first.index] = self.opened_at
        self.node.watch_lost(self._on_lost)

    def _on_lost(self, reason: str) -> None:
        self.lost = reason
        self.call.cancel()  # a pending read() ends now, even on a hung engine

    async def read(self) -> engine_pb2.GenerateResponse | None:
        """The next message, or None at the end of the stream; engine errors propagate (AioRpcError), and
        StreamLost when the node was lost meanwhile.

        Cancelling a read loses nothing (the call's `next_item`): a reader cancelled because the client
        left must leave the call open, and its message unread, for the drain that charges what the
        engine generated (handlers/drain.py)."""
        message = await self.call.next_item()
        try:
            if isinstance(message, BaseException):
                raise message
        except asyncio.CancelledError:  # the call was cancelled: by close(), or because the node was lost
            if self.lost is None:
                raise
            self.node.request_failed(grpc.StatusCode.UNAVAILABLE)
            raise StreamLost(self.node.address, self.lost) from None
        except grpc.aio.AioRpcError as exc:
            self.node.request_failed(exc.code())
            if self.lost is not None:
                raise StreamLost(self.node.address, self.lost) from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                # Its connection broke: the other streams on the node move too.
                self.node.mark_lost(f"stream of {self.first.request_id} broke: {exc.details()}")
            raise
        now = time.perf_counter()
        if message is grpc.aio.EOF:
            self.node.record_decode(now - self.opened_at, self.tokens_after_first)
            return None
        assert isinstance(message, engine_pb2.GenerateResponse)
        return self._accept(message, now)

    def ready(self) -> list[engine_pb2.GenerateResponse]:
        if self.closed:
            return []
        items = self.call.take_ready()
        if items:
            now = time.perf_counter()
            return [self._accept(item, now) for item in items]
        return items

    def push_to(self, push: Push | None) -> bool:
        # Each message pushed is accepted first, as `read` accepts it.
        pushed = None if push is None else Relayed(push, self._accept, self._accept_tokens)
        return self.call.push_to(pushed)

    def _accept(
        self, message: engine_pb2.GenerateResponse, now: float | None = None
    ) -> engine_pb2.GenerateResponse:
        """`_accept_tokens` of a message read (at `now`, else now); the message, as a read returns it."""
        self._accept_tokens(message, message.token_ids, now=now)  # each field read builds a wrapper: once
        return message

    def _accept_tokens(
        self,
        message: engine_pb2.GenerateResponse,
        token_ids: Sequence[int],
        text: str = "",
        now: float | None = None,
    ) -> None:
        """Count a message's tokens, and the gap since its choice's last ones (at `now`, else now)."""
        tokens = len(token_ids)
        self.tokens_after_first += tokens
        if tokens and self.token_gaps is not None:
            if now is None:
                now = time.perf_counter()
            index = message.index
            last = self._last_token_at.get(index)
            if last is not None:
                gaps = self._gaps
                if gaps is None:
                    gaps = self._gaps = TokenGaps(self.token_gaps)
                gaps.add(now - last)
            self._last_token_at[index] = now

    async def abort(self) -> None:
        if self.closed:
            raise RuntimeError(f"the stream of {self.first.request_id} is closed")
        await self.node.client.abort(self.first.request_id, ABORT_TIMEOUT_S)

    def close(self) -> None:
        """Cancel the call if it is still open (the engine sees CANCELLED and frees the request's blocks)
        and give back the node's in-flight slot; safe to call more than once."""
        if not self.closed:
            self.closed = True
            if self._gaps is not None:
                self._gaps.flush()
            self.node.unwatch_lost(self._on_lost)
            self.call.cancel()
            self.node.request_ended(self.blocks)


async def open_stream(
    pool: EnginePool,
    model: str,
    prompt_index: int,
    request: engine_pb2.GenerateRequest,
    timeout_s: float | None,
    on_retry: OnRetry,
    role: NodeRole = NodeRole.COLOCATED,
    exclude: Sequence[EngineNode] = (),
    on_left: OnLeftOpening | None = None,
) -> PromptStream:
    """Send `request` to a node of the `role` pool for `model` (not one of `exclude`) and wait for its
    first message, retrying refusals elsewhere.

    When the caller is cancelled (the client left) while the engine has the request, the engine may
    already be generating for it: with `on_left`, the call is not cancelled but handed over (a task that
    aborts the request and waits for its first message, `_open_late`), so that what it generated is
    drained and charged like any stream the client left."""
    route = await pool.route_request(model, request, role)
    request = prompt_as_token_ids(request, route.token_ids)
    metadata = (("x-request-id", request.request_id), *engine_trace_metadata())
    tried: list[EngineNode] = list(exclude)
    refusal: grpc.aio.AioRpcError | None = None
    while True:
        try:
            node = await pool.acquire(route, exclude=tried, role=role)
        except OpenAIError:
            if refusal is not None:
                raise refusal from None  # no other node to try: the client sees the refusal (429/503)
            raise
        blocks = _prompt_blocks(route.token_ids, node.block_size)
        node.request_started(blocks)
        call = node.client.generate(request, metadata, timeout_s)
        # The first read is shielded: it goes on when the caller is cancelled, for `on_left` to take over.
        first_read = asyncio.ensure_future(call.read())
        try:
            first = await asyncio.shield(first_read)
        except grpc.aio.AioRpcError as exc:
            node.request_ended(blocks)
            node.request_failed(exc.code())
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                pool.eject(node, f"Generate answered UNAVAILABLE: {exc.details()}")
            if exc.code() not in RETRYABLE or len(tried) - len(exclude) >= pool.config.retries:
                raise
            log.warning(
                "engine %s refused %s (%s), trying another",
                node.address,
                request.request_id,
                exc.code().name,
            )
            on_retry(exc.code())
            tried.append(node)
            refusal = exc
            continue
        except asyncio.CancelledError:
            if on_left is None:
                _give_up_opening(call, first_read, node, blocks)
            else:
                on_left(
                    asyncio.ensure_future(
                        _open_late(prompt_index, pool, node, call, first_read, request, blocks)
                    )
                )
            raise
        except BaseException:
            _give_up_opening(call, first_read, node, blocks)
            raise
        if first is grpc.aio.EOF:
            node.request_ended(blocks)
            raise OpenAIError(
                502,
                "the engine ended the stream without any output",
                type="server_error",
                code="engine_error",
            )
        predicted = route.predicted_blocks.get(node.address)
        if predicted is not None and role is not NodeRole.DECODE:  # a decode's cache counts pulled KV
            node.record_kv_prediction(predicted, first.usage.cached_tokens)
        return PromptStream(prompt_index, pool, node, call, first, blocks=blocks)


def _give_up_opening(
    call: MessageSource,
    first_read: asyncio.Future[object],
    node: EngineNode,
    blocks: int,
) -> None:
    first_read.cancel()
    call.cancel()
    node.request_ended(blocks)


async def _open_late(
    prompt_index: int,
    pool: EnginePool,
    node: EngineNode,
    call: MessageSource,
    first_read: asyncio.Future[object],
    request: engine_pb2.GenerateRequest,
    blocks: int,
) -> PromptStream | None:
    """The client left while this prompt's stream was opening: stop the request on the engine (Abort)
    and wait for its first message. A stream the engine had generated for comes back open, for the
    drain to read to its end (its Abort again is answered `aborted: false`); None for one that ended
    before any token (it was still waiting in the engine's queue: nothing to charge) or that failed."""
    try:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await node.client.abort(request.request_id, ABORT_TIMEOUT_S)
        first = await asyncio.wait_for(first_read, LATE_OPEN_TIMEOUT_S)
    except (grpc.aio.AioRpcError, TimeoutError):
        _give_up_opening(call, first_read, node, blocks)
        return None
    except BaseException:
        _give_up_opening(call, first_read, node, blocks)
        raise
    if first is grpc.aio.EOF or (first.finished and not first.usage.completion_tokens):
        _give_up_opening(call, first_read, node, blocks)
        return None
    return PromptStream(prompt_index, pool, node, call, first, blocks=blocks)


def prompt_as_token_ids(
    request: engine_pb2.GenerateRequest, token_ids: tuple[int, ...] | None
) -> engine_pb2.GenerateRequest:
    """A text prompt that routing had tokenized (kv_aware: an engine's Tokenize, the very tokenization
    Generate applies to text) is sent as those ids, so the engine does not tokenize it a second time.
    Only non-empty text: an empty one keeps the engine's own error, and chat keeps its template's
    defaults (e.g. max_tokens). The caller's request is left as it is."""
    if token_ids is None or request.WhichOneof("input") != "text" or not request.text:
        return request
    sent = engine_pb2.GenerateRequest()
    sent.CopyFrom(request)
    sent.token_ids.ids.extend(token_ids)  # replaces the text (one input)
    return sent


def _prompt_blocks(token_ids: tuple[int, ...] | None, block_size: int | None) -> int:
    """KV blocks a prompt takes (0 when its tokens are not known: only kv_aware asks for them)."""
    return -(-len(token_ids) // block_size) if token_ids and block_size else 0


async def open_streams(
    requests: Sequence[engine_pb2.GenerateRequest],
    open_one: OpenOne,
    left: list[EngineStream] | None = None,
) -> list[EngineStream]:
    """Open one stream per prompt concurrently; if any fails, close the others and raise its error.

    When the caller is cancelled (the client left) the streams already open go to `left` instead of
    closing, for the caller to drain (handlers/drain.py)."""
    if len(requests) == 1:
        return [await open_one(0, requests[0])]
    tasks = [asyncio.ensure_future(open_one(index, request)) for index, request in enumerate(requests)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as exc:
        keep = left is not None and isinstance(exc, asyncio.CancelledError)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                continue
            if keep and left is not None:
                left.append(result)
            else:
                result.close()
        raise


# Messages read from a prompt's stream but not yet handed to the reader: (prompt index, message).
Unread = list[tuple[int, engine_pb2.GenerateResponse]]


# What a prompt's pump task puts in the shared queue: a message, the stream's end (None), or its error.
_Pumped = tuple[int, engine_pb2.GenerateResponse | BaseException | None]


def _pump_all(streams: Sequence[EngineStream]) -> tuple[asyncio.Queue[_Pumped], list[asyncio.Task[None]]]:
    """A task per stream reading it into one queue: each message, then None at its end, or its error
    (handed to the reader, which raises it). The caller cancels the tasks."""
    queue: asyncio.Queue[_Pumped] = asyncio.Queue()

    async def pump(stream: EngineStream) -> None:
        try:
            while (message := await stream.read()) is not None:
                queue.put_nowait((stream.prompt_index, message))
            queue.put_nowait((stream.prompt_index, None))
        except Exception as exc:
            queue.put_nowait((stream.prompt_index, exc))

    return queue, [asyncio.create_task(pump(stream)) for stream in streams]


async def read_messages(
    streams: Sequence[EngineStream], unread: Unread | None = None
) -> AsyncIterator[tuple[int, engine_pb2.GenerateResponse]]:
    """Yield (prompt index, message) as messages arrive, first messages first, until every stream ends.

    An engine error on any stream propagates (as grpc.aio.AioRpcError); the caller closes the streams.
    When the reader stops early, the messages already read from the streams and not yet yielded are
    appended to `unread` (their usage and endings still count).
    """
    for stream in streams:
        yield stream.prompt_index, stream.first
    if len(streams) == 1:
        # The common case needs no queue: read straight from the call as tokens arrive.
        stream = streams[0]
        while (message := await stream.read()) is not None:
            yield stream.prompt_index, message
        return
    queue, tasks = _pump_all(streams)
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
        while not queue.empty():
            prompt_index, item = queue.get_nowait()
            if unread is not None and isinstance(item, engine_pb2.GenerateResponse):
                unread.append((prompt_index, item))


# A batch of messages read at once: (prompt index, message), in the order they were read.
Batch = list[tuple[int, engine_pb2.GenerateResponse]]


async def read_batches(
    streams: Sequence[EngineStream], unread: Unread | None, pace: ClientPace | None
) -> AsyncIterator[Batch]:
    """`read_messages` in batches: each waits for one message; while the client is behind, it waits for
    the client to catch up and takes along every message that arrived meanwhile (handlers/coalesce.py
    merges them). Each stream's order is kept; its end or error comes after the batch."""
    if len(streams) != 1:
        async with contextlib.aclosing(_read_several(streams, unread, pace)) as batches:
            async for batch in batches:
                yield batch
        return
    stream = streams[0]
    yield [(stream.prompt_index, stream.first)]
    ready = getattr(stream, "ready", None)
    while (message := await stream.read()) is not None:
        batch = [(stream.prompt_index, message)]
        if ready is not None and pace is not None and pace.behind:
            await _catch_up(pace, batch, unread)
            batch += [(stream.prompt_index, more) for more in ready()]
        yield batch


async def _catch_up(pace: ClientPace, batch: Batch, unread: Unread | None) -> None:
    """Wait for the client to read what it is behind on; if it leaves meanwhile, the drain counts `batch`."""
    try:
        await pace.caught_up()
    except BaseException:
        if unread is not None:
            unread.extend(batch)
        raise


async def _read_several(
    streams: Sequence[EngineStream], unread: Unread | None, pace: ClientPace | None
) -> AsyncIterator[Batch]:
    """`read_batches` of several prompts' streams: a task per stream reads it into one queue; a batch
    takes what the queue holds once the client caught up, up to the first stream error (raised after it)."""
    yield [(stream.prompt_index, stream.first) for stream in streams]
    queue, tasks = _pump_all(streams)
    failure: BaseException | None = None  # a stream's error, raised once the messages before it went out
    try:
        remaining = len(streams)
        while remaining:
            if failure is not None:
                raise failure
            prompt_index, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            batch: Batch = [(prompt_index, item)]
            if pace is not None and pace.behind:
                await _catch_up(pace, batch, unread)
                while not queue.empty():
                    prompt_index, item = queue.get_nowait()
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        failure = item
                        break
                    else:
                        batch.append((prompt_index, item))
            yield batch
    finally:
        for task in tasks:
            task.cancel()
        while not queue.empty():
            prompt_index, item = queue.get_nowait()
            if unread is not None and isinstance(item, engine_pb2.GenerateResponse):
                unread.append((prompt_index, item))


def close_all(streams: Sequence[EngineStream]) -> None:
    for stream in streams:
        stream.close()
