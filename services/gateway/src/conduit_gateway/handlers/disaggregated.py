"""Disaggregated serving of one prompt: a prefill engine runs the prompt and samples each choice's first
token, a decode engine pulls the prompt's KV and generates the rest; the client reads one stream.

1. The request goes to the prefill pool with `kv_transfer.produce` (a refusal is retried on another prefill
   engine, as for any request). Its messages are relayed at once, so the first token reaches the client
   from the prefill engine. A choice it ends with KV_HANDOFF is relayed as not finished and its handle is
   kept; a choice its first token ended (a stop, max_tokens) is relayed as it is.
2. When the prefill stream ends with choices handed off, the same request goes to the decode pool with
   `kv_transfer.consume`: the handle and those choices' first tokens. A refusal (queue full, engine down)
   is retried on another decode engine with the same handle; when none is left the transfer is released
   (ReleaseKv) and the refusal reaches the client: 429 before any output, an error event in a stream.
3. The decode messages are relayed with the usage the client would see colocated: prompt and cached
   tokens from the prefill engine, completion tokens summed over both engines.

A stream closed before a decode engine took its transfer (the client went away, an error) releases the
transfer; the prefill engine's lease frees it in any case. Prompt logprobs come from the prefill engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import OpenAIError
from conduit_gateway.handlers.streams import OnLeftOpening, OnRetry, OpenOne, PromptStream, open_stream
from conduit_gateway.routing.client import EngineClient
from conduit_gateway.routing.node import EngineNode
from conduit_gateway.routing.pool import EnginePool
from conduit_gateway.routing.roles import NodeRole

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0
# ReleaseKv calls made from close() (which cannot await), kept referenced until they finish.
_releases: set[asyncio.Task[None]] = set()


def uses_disaggregation(pool: EnginePool, model: str) -> bool:
    """Whether `model`'s requests go prefill → decode: the pool has prefill and decode engines and, when
    colocated engines are there too, a prefill and a decode engine serving `model` are ready now (else the
    colocated engines serve it)."""
    if not (pool.members(NodeRole.PREFILL) and pool.members(NodeRole.DECODE)):
        return False
    if not pool.members(NodeRole.COLOCATED):
        return True
    return all(
        any(node.model == model for node in pool.routable(role))
        for role in (NodeRole.PREFILL, NodeRole.DECODE)
    )


def stream_opener(
    pool: EnginePool,
    model: str,
    timeout_s: float | None,
    on_retry: OnRetry,
    on_left: OnLeftOpening | None = None,
) -> OpenOne:
    """How each prompt's stream opens for `model`: on one engine, or across a prefill/decode pair.
    `on_left`: told of each prompt whose opening the client left (handlers/streams.py open_stream)."""
    if not uses_disaggregation(pool, model):
        return lambda index, request: open_stream(
            pool, model, index, request, timeout_s, on_retry, on_left=on_left
        )

    async def open_pair(index: int, request: engine_pb2.GenerateRequest) -> DisaggregatedStream:
        produce = engine_pb2.GenerateRequest()
        produce.CopyFrom(request)
        produce.kv_transfer.produce.SetInParent()
        prefill = await open_stream(
            pool, model, index, produce, timeout_s, on_retry, NodeRole.PREFILL, on_left=on_left
        )
        try:
            return DisaggregatedStream(request, prefill, DecodeTarget(pool, model, timeout_s, on_retry))
        except BaseException:
            prefill.close()
            raise

    return open_pair


def continuation_opener(
    pool: EnginePool, model: str, timeout_s: float | None, on_retry: OnRetry
) -> Callable[[int, engine_pb2.GenerateRequest, Sequence[EngineNode]], Awaitable[PromptStream]]:
    """Where a migrated stream's continuation goes: a colocated engine, or with disaggregation a decode
    engine, which runs the continuation as a whole request (a continuation has no kv_transfer)."""

    async def reopen(
        index: int, request: engine_pb2.GenerateRequest, exclude: Sequence[EngineNode]
    ) -> PromptStream:
        role = NodeRole.DECODE if uses_disaggregation(pool, model) else NodeRole.COLOCATED
        return await open_stream(pool, model, index, request, timeout_s, on_retry, role, exclude)

    return reopen


class DecodeTarget:
    """Where and how a disaggregated stream opens its decode side."""

    def __init__(self, pool: EnginePool, model: str, timeout_s: float | None, on_retry: OnRetry) -> None:
        self.pool = pool
        self.model = model
        self.timeout_s = timeout_s
        self.on_retry = on_retry

    async def open(self, prompt_index: int, request: engine_pb2.GenerateRequest) -> PromptStream:
        return await open_stream(
            self.pool, self.model, prompt_index, request, self.timeout_s, self.on_retry, NodeRole.DECODE
        )


class DisaggregatedStream:
    """One prompt's prefill stream, then its decode stream, read as one EngineStream."""

    def __init__(
        self, request: engine_pb2.GenerateRequest, prefill: PromptStream, decode_target: DecodeTarget
    ) -> None:
        self.prompt_index = prefill.prompt_index
        self._request = request
        self._prefill = prefill
        self._target = decode_target
        self._decode: PromptStream | None = None
        self._prefill_done = False
        self._prefill_usage = engine_pb2.Usage()
        self._handle: engine_pb2.KvHandle | None = None
        self._first_tokens: dict[int, int] = {}  # choice index → its first token, for choices handed off
        self._unclaimed = False  # a handle no decode engine has taken yet
        self._completion_before = 0  # completion tokens of the choices that ended on the prefill engine
        self._aborted = False  # stopped on purpose: no decode side opens after the prefill
        self._decode_interrupted = False  # its decode side failed or was cancelled while opening
        self.first = self._from_prefill(prefill.first)

    @property
    def node(self) -> EngineNode:
        """The engine serving the stream now: the prefill engine until the decode engine takes over."""
        return self._prefill.node if self._decode is None else self._decode.node

    async def read(self) -> engine_pb2.GenerateResponse | None:
        if not self._prefill_done:
            message = await self._prefill.read()
            if message is not None:
                return self._from_prefill(message)
            self._prefill_done = True
            if not self._first_tokens or self._aborted:
                return None  # every choice ended at its first token, or the stream was stopped
            self._decode = await self._open_decode()
            return self._from_decode(self._decode.first)
        if self._decode is None:
            if self._decode_interrupted:
                # A decode engine may have generated tokens whose first message never arrived.
                raise RuntimeError("the decode side did not open: what it generated is unknown")
            return None
        message = await self._decode.read()
        return None if message is None else self._from_decode(message)

    def ready(self) -> list[engine_pb2.GenerateResponse]:
        """The decode side's ready messages once it serves the stream (the prefill side: none)."""
        if self._decode is None:
            return []
        return [self._from_decode(message) for message in self._decode.ready()]

    def push_to(self, push: object) -> bool:
        """Its messages are only read (the decode stream opens while it is read)."""
        return False

    async def abort(self) -> None:
        """Abort on the engine serving the stream now; a prefill's hand-offs are then not decoded (close()
        releases their transfer)."""
        self._aborted = True
        await (self._prefill if self._decode is None else self._decode).abort()

    def close(self) -> None:
        self._prefill.close()
        if self._decode is not None:
            self._decode.close()
        self._release()

    def _from_prefill(self, message: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """A prefill message as the client sees it: a hand-off is only the choice's first token."""
        self._prefill_usage = message.usage
        if message.finish_reason != engine_pb2.FINISH_REASON_KV_HANDOFF:
            return message
        if len(message.token_ids) != 1 or not message.HasField("kv_handle"):
            raise OpenAIError(
                502,
                f"The prefill engine handed off choice {message.index} without one token and a handle.",
                type="server_error",
                code="engine_error",
            )
        self._handle = message.kv_handle
        self._unclaimed = True
        self._first_tokens[message.index] = message.token_ids[0]
        relayed = engine_pb2.GenerateResponse()
        relayed.CopyFrom(message)
        relayed.ClearField("kv_handle")
        relayed.finished = False
        relayed.finish_reason = engine_pb2.FINISH_REASON_UNSPECIFIED
        return relayed

    async def _open_decode(self) -> PromptStream:
        """The decode side: the same request with the handle and first tokens (released if none takes it)."""
        assert self._handle is not None
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        request.sampling.ClearField("prompt_logprobs")  # the prefill engine returned them
        consume = request.kv_transfer.consume
        consume.handle.CopyFrom(self._handle)
        consume.first_tokens.extend(
            engine_pb2.KvFirstToken(index=index, token_id=token)
            for index, token in sorted(self._first_tokens.items())
        )
        try:
            stream = await self._target.open(self.prompt_index, request)
        except BaseException:
            self._decode_interrupted = True
            self._release()
            raise
        self._unclaimed = False
        self._completion_before = self._prefill_usage.completion_tokens - len(self._first_tokens)
        return stream

    def _from_decode(self, message: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
        """Usage as colocated: the prefill's prompt and cached tokens, both sides' completion tokens."""
        completion = message.usage.completion_tokens + self._completion_before
        message.usage.CopyFrom(
            engine_pb2.Usage(
                prompt_tokens=self._prefill_usage.prompt_tokens,
                cached_tokens=self._prefill_usage.cached_tokens,
                completion_tokens=completion,
            )
        )
        return message

    def _release(self) -> None:
        """ReleaseKv on the prefill engine, once, for a handle no decode engine took (in the background)."""
        if not self._unclaimed or self._handle is None:
            return
        self._unclaimed = False
        transfer_id, node = self._handle.transfer_id, self._prefill.node
        try:
            task = asyncio.get_running_loop().create_task(_release(node.client, node.address, transfer_id))
        except RuntimeError:  # no event loop any more (shutdown): the lease frees the blocks
            return
        _releases.add(task)
        task.add_done_callback(_releases.discard)


async def _release(client: EngineClient, address: str, transfer_id: str) -> None:
    try:
        released = await client.release_kv(transfer_id, RELEASE_TIMEOUT_S)
    except Exception as exc:  # best effort: the lease frees the blocks anyway
        log.warning("ReleaseKv %s at %s failed (its lease frees it): %s", transfer_id, address, exc)
        return
    log.info("released KV transfer %s at %s (%s)", transfer_id, address, "freed" if released else "gone")
