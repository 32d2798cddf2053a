"""The Engine gRPC service: proto → domain objects → engine → proto, and the status each error travels as.

PullKv and ReleaseKv (engine to engine, for disaggregation) delegate to `kv_transfer.service`. The process
around it (health, reflection, start, drain, signals) is `entrypoints/server.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry.trace import Status, StatusCode

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_common.logs import current_request_id
from conduit_common.secret_files import TokenFile
from conduit_engine.core.kv_events import BlockRemoved, BlockStored, KvEvent, KvEventBatch
from conduit_engine.engine.async_engine import AsyncEngine
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.entrypoints.generate_stream import GenerateStreamSession, ProtocolError
from conduit_engine.entrypoints.proto_mapping import (
    messages_from_pb,
    output_to_pb,
    request_from_pb,
    template_extras_from_pb,
)
from conduit_engine.entrypoints.security import token_problem
from conduit_engine.errors import (
    EngineError,
    EngineUnavailableError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    QueueFullError,
)
from conduit_engine.kv_transfer.errors import KvTransferError
from conduit_engine.kv_transfer.proto import handle_to_pb, layout_to_pb
from conduit_engine.kv_transfer.registry import KvTransfer
from conduit_engine.kv_transfer.service import KvTransferService
from conduit_engine.telemetry import EngineTelemetry
from conduit_engine.telemetry.tracing import KV_BLOCKS, KV_BYTES

if TYPE_CHECKING:
    from conduit_engine.lora.manager import AdapterInfo

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
_METHOD_PREFIX = f"/{SERVICE_NAME}/"
# Blocks per snapshot message: 2,048 blocks of 16 tokens are about 200 KB, far below the message limit.
SNAPSHOT_CHUNK_BLOCKS = 2048
# Tokenize texts up to this long on the event loop itself (well under a millisecond of tokenizing on an
# idle core): kv_aware routing asks it for every request, and the two hops through the tokenizer pool
# cost more than the tokenizing (a busy engine answered in a p50 of 4-9 ms inline against 11-13 ms).
INLINE_TOKENIZE_CHARS = 2048
_ROLES = {"both": pb.ENGINE_ROLE_BOTH, "prefill": pb.ENGINE_ROLE_PREFILL, "decode": pb.ENGINE_ROLE_DECODE}


class ModelNotFoundError(EngineError):
    """The request names a model this engine does not serve (→ NOT_FOUND)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The one place engine errors become gRPC status codes."""
    if isinstance(exc, KvTransferError):
        return grpc.StatusCode[exc.grpc_code]
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ModelNotFoundError | NotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, FailedPreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by Engine RPCs into status codes with the exception's message."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_METHOD_PREFIX):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in an Engine RPC")
    await context.abort(code, str(exc))


async def _abort_unexpected(context: grpc.aio.ServicerContext) -> None:
    # The traceback goes to the log only: clients get a generic INTERNAL, never internals.
    log.exception("unexpected error in an Engine RPC")
    await context.abort(grpc.StatusCode.INTERNAL, "internal error in the engine (details are in its log)")


def _wrap_unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await inner(request, context)
        except (EngineError, ValueError) as exc:
            await _abort_for(exc, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _abort_unexpected(context)

    return call


def _wrap_stream(inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in inner(request, context):
                yield item
        except (EngineError, ValueError) as exc:
            await _abort_for(exc, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _abort_unexpected(context)

    return call


def _metadata_request_id(metadata: Sequence[tuple[str, str]]) -> str | None:
    for key, value in metadata:
        if key == "x-request-id" and value:
            return str(value)
    return None


class EngineServicer(pb_grpc.EngineServicer):
    """Registered before the model loads: every RPC answers UNAVAILABLE until `attach()`.

    Requests are validated once, by the engine's admission (draining included); the servicer only
    converts messages and refuses what is gRPC-specific (a wrong model name, warm-up not done).
    """

    def __init__(self, device: str, telemetry: EngineTelemetry) -> None:
        self.device = device
        self.telemetry = telemetry
        self._async_engine: AsyncEngine | None = None
        self._kv_service: KvTransferService | None = None
        self.advertise_address = ""
        # The largest message the server takes (its grpc.max_receive_message_length): a GenerateStream
        # batch of actions up to this size is taken.
        self.receive_bytes = 0
        self.ready = False
        # --auth-token-file: checked again at each request opened on a GenerateStream (the interceptor
        # checks a call's token when it starts).
        self.token: TokenFile | None = None

    def attach(self, async_engine: AsyncEngine, advertise_address: str, max_message_bytes: int) -> None:
        self._kv_service = async_engine.core.kv_transfer_service(async_engine.run_sync, max_message_bytes)
        self.advertise_address = advertise_address
        self._async_engine = async_engine

    @property
    def async_engine(self) -> AsyncEngine:
        if self._async_engine is None:
            raise EngineUnavailableError("the engine is still loading the model")
        return self._async_engine

    @property
    def core(self) -> LLMEngine:
        """The synchronous engine, for its immutable facts (model name, tokenizer, limits)."""
        return self.async_engine.core

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for message in self.generate_messages(request, context.invocation_metadata() or ()):
            yield message

    async def GenerateStream(
        self, request_iterator: AsyncIterator[pb.GenerateStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamBatch]:
        # Taken: the client writes its requests once it has these (see the proto).
        await context.send_initial_metadata(())
        token, metadata = self.token, context.invocation_metadata() or ()
        authorize = (lambda: token_problem(token, metadata)) if token is not None else None
        session = GenerateStreamSession(self.generate_messages, status_for, authorize)
        try:
            async for batch in session.run(request_iterator):
                yield batch
        except ProtocolError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def generate_messages(
        self, request: pb.GenerateRequest, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate call's messages, whether it came as its own call or on a GenerateStream."""
        if not self.ready:
            raise EngineUnavailableError("the engine is still warming up")
        lora = self._adapter_of(request)
        req = request_from_pb(request)
        req.lora = lora
        if not request.request_id:
            req.request_id = _metadata_request_id(metadata) or req.request_id
        current_request_id.set(req.request_id)  # this call's log lines carry it
        req.trace_context = trace = self.telemetry.request_trace(metadata)
        decode = self.core.tokenizer.token_text
        sent = False
        try:
            async for out in self.async_engine.generate(req):
                sent = True
                yield output_to_pb(out, decode, self._handle)
        except EngineError as exc:
            if not sent:  # refused at admission: the engine never saw it, no record ends its span
                self.telemetry.refused(trace, exc)
            raise

    def _adapter_of(self, request: pb.GenerateRequest) -> str | None:
        """The LoRA adapter the request's model names (None: the base model); NOT_FOUND for neither."""
        model, core = request.model, self.core
        if not request.HasField("model") or not model or model == core.model_name:
            return None
        if core.lora is not None and core.lora.has(model):
            return model
        served = f"{core.model_name!r}" + (f" and adapters {core.lora.names()}" if core.lora else "")
        raise ModelNotFoundError(f"model {model!r} is not served here (this engine serves {served})")

    # ----- LoRA adapters -------------------------------------------------------------------------------
    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadLoraAdapterResponse:
        if not request.lora_name:
            raise InvalidRequestError("lora_name", "must not be empty")
        if not request.lora_path:
            raise InvalidRequestError("lora_path", "must not be empty")
        core = self.core
        # On the engine thread between steps: the pool and the prefix-cache roots change there only.
        info = await self.async_engine.run_sync(lambda: core.load_lora(request.lora_name, request.lora_path))
        return pb.LoadLoraAdapterResponse(adapter=self._adapter_pb(info))

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        if not request.lora_name:
            raise InvalidRequestError("lora_name", "must not be empty")
        core = self.core
        await self.async_engine.run_sync(lambda: core.unload_lora(request.lora_name))
        return pb.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoraAdaptersResponse:
        core = self.core
        infos = await self.async_engine.run_sync(core.list_loras)
        max_loras = core.config.lora.max_loras if core.lora is not None else 0
        return pb.ListLoraAdaptersResponse(adapters=[self._adapter_pb(i) for i in infos], max_loras=max_loras)

    def _adapter_pb(self, info: AdapterInfo) -> pb.LoraAdapter:
        return pb.LoraAdapter(name=info.name, path=info.path, rank=info.rank, parent=self.core.model_name)

    def _handle(self, transfer: KvTransfer) -> pb.KvHandle:
        return handle_to_pb(
            transfer, self.advertise_address, self.core.kv_layout, self.core.kv_transports.offered
        )

    @property
    def kv_service(self) -> KvTransferService:
        if self._kv_service is None:
            raise EngineUnavailableError("the engine is still loading the model")
        return self._kv_service

    async def PullKv(
        self, request: pb.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvChunk]:
        # Served while draining too: decode engines still pull the transfers produced here.
        span = self.telemetry.pull_kv_span(context.invocation_metadata(), request.transfer_id)
        blocks = sent = 0
        try:
            async for chunk in self.kv_service.pull_kv(request, context):
                blocks, sent = blocks + chunk.num_blocks, sent + len(chunk.data)
                yield chunk
        except BaseException as exc:  # refused (aborted with a status) or cancelled by the puller
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            if span is not None:
                span.set_attributes({KV_BLOCKS: blocks, KV_BYTES: sent})
                span.end()

    async def ReleaseKv(
        self, request: pb.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseKvResponse:
        return await self.kv_service.release_kv(request, context)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        return pb.AbortResponse(aborted=await self.async_engine.abort(request.request_id))

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        if request.WhichOneof("input") == "text" and len(request.text) <= INLINE_TOKENIZE_CHARS:
            return self._tokenize(request)
        # In the tokenizer pool: a long text or a chat template never stalls this event loop's other
        # calls and streams.
        return await self.async_engine.off_loop(self._tokenize, request)

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        tok, bound = self.core.tokenizer, self.core.prompt_bound
        kind = request.WhichOneof("input")
        if kind == "text":
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            bound.check("text", request.text)
            ids = tok.encode(request.text, add_special_tokens=add_special)
        elif kind == "chat":
            add_prompt = (
                request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            )
            tools, documents = template_extras_from_pb(request.chat)
            text = tok.render_chat(messages_from_pb(request.chat), add_prompt, tools, documents)
            bound.check("chat", text)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            raise InvalidRequestError("input", "one of text or chat is required")
        if request.ids_only:
            return pb.TokenizeResponse(token_ids=ids)
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.token_text(i) for i in ids])

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        ids = list(request.token_ids)
        vocab = self.core.arch.vocab_size
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self.async_engine.off_loop(self.core.tokenizer.decode, ids, skip)
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        core = self.core
        return pb.GetModelInfoResponse(
            model=core.model_name,
            architecture=core.arch.architecture,
            vocab_size=core.arch.vocab_size,
            max_model_len=core.max_model_len,
            dtype=core.dtype,
            device=self.device,
            block_size=core.block_size,
            num_kv_blocks=core.num_blocks,
            max_num_seqs=core.config.scheduler.max_num_seqs,
            eos_token_ids=list(core.eos_token_ids),
            has_chat_template=core.tokenizer.chat_template is not None,
            role=_ROLES[core.config.disaggregation.role],
            kv_layout=layout_to_pb(core.kv_layout),
            advertise_address=self.advertise_address,
            kv_transport=core.kv_transports.kind,
            max_prompt_bytes=core.prompt_bound.max_bytes,
            kv_cache_dtype=core.kv_layout.dtype,
            kv_cache_tokens=core.num_blocks * core.block_size,
            kv_block_bytes=core.kv_layout.block_bytes,
            generate_stream=True,
            generate_stream_batch_bytes=self.receive_bytes,
        )

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadResponse:
        stats = await self.async_engine.stats()
        spec = stats.spec_decode
        return pb.GetLoadResponse(
            running_requests=stats.running,
            waiting_requests=stats.waiting,
            kv_blocks_used=stats.blocks.used,
            kv_blocks_total=stats.blocks.total,
            kv_blocks_cached=stats.blocks.cached,
            prefix_cache_hit_rate=stats.blocks.hit_rate,
            finished_requests=stats.finished_requests,
            generated_tokens=stats.generated_tokens,
            kv_transfers_pending=stats.kv_transfers_pending,
            kv_blocks_pinned=stats.blocks.pinned,
            kv_bytes_pulled=stats.kv_bytes_pulled,
            kv_bytes_saved=stats.kv_bytes_saved,
            spec_decode_acceptance_rate=0.0 if spec is None else spec.acceptance_rate,
            spec_decode_draft_tokens=0 if spec is None else spec.num_draft_tokens,
            spec_decode_accepted_tokens=0 if spec is None else spec.num_accepted_tokens,
            kv_pulls_by_transport=self.async_engine.kv_pulls_by_transport,
            lora_adapters=stats.lora_adapters,
        )

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        publisher = self.core.kv_events
        snapshot, batches = await publisher.subscribe(self.async_engine.run_sync)
        engine_id, block_size = publisher.engine_id, publisher.block_size
        blocks = snapshot.blocks
        for start in range(0, max(1, len(blocks)), SNAPSHOT_CHUNK_BLOCKS):
            chunk = blocks[start : start + SNAPSHOT_CHUNK_BLOCKS]
            yield pb.KvEventBatch(
                sequence=snapshot.sequence,
                snapshot=True,
                snapshot_done=start + SNAPSHOT_CHUNK_BLOCKS >= len(blocks),
                engine_id=engine_id,
                created_unix_ms=_now_ms(),
                events=[_stored_to_pb(block, block_size) for block in chunk],
                num_cached_blocks=len(blocks),
            )
        async for batch in batches:
            yield kv_batch_to_pb(batch, engine_id, block_size)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _stored_to_pb(event: BlockStored, block_size: int) -> pb.KvEvent:
    return pb.KvEvent(
        stored=pb.BlockStored(
            block_hash=event.block_hash,
            parent_hash=event.parent_hash or b"",
            token_ids=event.token_ids,
            block_size=block_size,
        )
    )


def kv_batch_to_pb(batch: KvEventBatch, engine_id: str, block_size: int) -> pb.KvEventBatch:
    """One live batch as its message; consecutive removals travel as one BlockRemoved."""
    events: list[pb.KvEvent] = []
    removed: list[bytes] = []
    event: KvEvent
    for event in batch.events:
        if isinstance(event, BlockRemoved):
            removed.append(event.block_hash)
            continue
        if removed:
            events.append(pb.KvEvent(removed=pb.BlockRemoved(block_hashes=removed)))
            removed = []
        if isinstance(event, BlockStored):
            events.append(_stored_to_pb(event, block_size))
        else:
            events.append(pb.KvEvent(cleared=pb.AllCleared()))
    if removed:
        events.append(pb.KvEvent(removed=pb.BlockRemoved(block_hashes=removed)))
    return pb.KvEventBatch(
        sequence=batch.sequence,
        engine_id=engine_id,
        created_unix_ms=batch.created_unix_ms,
        events=events,
        num_cached_blocks=batch.num_cached,
    )
