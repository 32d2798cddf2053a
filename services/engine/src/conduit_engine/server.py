"""Thin grpc.aio servicer: proto → domain objects → engine → proto, plus health, reflection and drain.

PullKv and ReleaseKv (engine to engine, for disaggregation) delegate to `kv_transfer.service`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_common.logs import current_request_id
from conduit_engine.async_engine import AsyncEngine
from conduit_engine.config import EngineConfig
from conduit_engine.engine import LLMEngine
from conduit_engine.errors import (
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    QueueFullError,
    WorkerFailedError,
)
from conduit_engine.kv_transfer.errors import KvTransferError
from conduit_engine.kv_transfer.proto import handle_to_pb, layout_to_pb
from conduit_engine.kv_transfer.registry import KvTransfer
from conduit_engine.kv_transfer.service import KvTransferService
from conduit_engine.parallel.worker_group import WorkerGroup
from conduit_engine.proto_mapping import (
    messages_from_pb,
    output_to_pb,
    request_from_pb,
    template_extras_from_pb,
)
from conduit_engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.server_security import ServerSecurity, engine_dialer
from conduit_engine.telemetry import EngineTelemetry
from conduit_engine.telemetry.tracing import KV_BLOCKS, KV_BYTES

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
_METHOD_PREFIX = f"/{SERVICE_NAME}/"
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
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND
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


def _metadata_request_id(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
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
        self.ready = False

    def attach(self, async_engine: AsyncEngine, advertise_address: str, max_message_bytes: int) -> None:
        core = async_engine.core
        self._kv_service = KvTransferService(
            core.kv_registry,
            core.runner,
            core.kv_layout,
            run_on_engine=async_engine.run_sync,
            chunk_bytes=core.config.disaggregation.chunk_bytes,
            max_message_bytes=max_message_bytes,
        )
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
        if not self.ready:
            raise EngineUnavailableError("the engine is still warming up")
        if request.HasField("model") and request.model and request.model != self.core.model_name:
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here (this engine serves {self.core.model_name!r})"
            )
        req = request_from_pb(request)
        if not request.request_id:
            req.request_id = _metadata_request_id(context) or req.request_id
        current_request_id.set(req.request_id)  # this call's log lines carry it
        req.trace_context = trace = self.telemetry.request_trace(context.invocation_metadata())
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

    def _handle(self, transfer: KvTransfer) -> pb.KvHandle:
        return handle_to_pb(transfer, self.advertise_address, self.core.kv_layout)

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
        tok = self.core.tokenizer
        kind = request.WhichOneof("input")
        if kind == "text":
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = tok.encode(request.text, add_special_tokens=add_special)
        elif kind == "chat":
            add_prompt = (
                request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            )
            tools, documents = template_extras_from_pb(request.chat)
            ids = tok.encode_chat(messages_from_pb(request.chat), add_prompt, tools, documents)
        else:
            raise InvalidRequestError("input", "one of text or chat is required")
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
        return pb.DetokenizeResponse(text=self.core.tokenizer.decode(ids, skip_special_tokens=skip))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        core = self.core
        return pb.GetModelInfoResponse(
            model=core.model_name,
            architecture=core.arch.architecture,
            vocab_size=core.arch.vocab_size,
            max_model_len=core.max_model_len,
            dtype=str(core.dtype).removeprefix("torch."),
            device=self.device,
            block_size=core.block_size,
            num_kv_blocks=core.num_blocks,
            max_num_seqs=core.config.scheduler.max_num_seqs,
            eos_token_ids=list(core.eos_token_ids),
            has_chat_template=core.tokenizer.chat_template is not None,
            role=_ROLES[core.config.disaggregation.role],
            kv_layout=layout_to_pb(core.kv_layout),
            advertise_address=self.advertise_address,
        )

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadResponse:
        stats = await self.async_engine.stats()
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
        )


async def warm_up(async_engine: AsyncEngine) -> None:
    """One short generation through the whole path; health turns SERVING only after it succeeds."""
    core = async_engine.core
    first = core.arch.bos_token_id if core.arch.bos_token_id is not None else 0
    req = GenerationRequest(
        request_id=f"warmup-{uuid.uuid4().hex}",
        params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        token_ids=[first],
    )
    async for out in async_engine.generate(req):
        if out.error is not None:
            raise EngineError(f"warm-up generation failed: {out.error}")


# After a worker failure: how long the failed streams get to send their error before gRPC stops.
_FAILED_STREAMS_GRACE_S = 2.0


class EngineServer:
    """Owns the grpc.aio server: start (NOT_SERVING) → load → warm up → SERVING → drain on signal.

    With worker processes, they are spawned first, before this process creates any gRPC object. A
    worker failure turns health to NOT_SERVING, lets the failed streams send their error, stops gRPC
    and makes `serve` raise WorkerFailedError (the CLI then exits non-zero).
    """

    def __init__(self, config: EngineConfig, tracer_provider: TracerProvider | None = None) -> None:
        """`tracer_provider` replaces the one --otlp-endpoint would make (tests read spans in memory)."""
        self.config = config
        parallel = config.parallel
        self.workers = WorkerGroup(parallel.tensor_parallel_size) if parallel.uses_workers else None
        self.failure: str | None = None
        # After the workers: an OTLP exporter opens a gRPC channel.
        self.telemetry = EngineTelemetry(config.telemetry, config.server.host, tracer_provider)
        self.health = health.aio.HealthServicer()
        server = config.server
        options = [
            ("grpc.max_send_message_length", server.max_message_bytes),
            ("grpc.max_receive_message_length", server.max_message_bytes),
            ("grpc.keepalive_time_ms", int(server.keepalive_seconds * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", int(server.min_ping_interval_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        self.security = ServerSecurity(config.security)
        # Towards other engines (PullKv, ReleaseKv): TLS and the token of the --engine-tls-* flags.
        self.engine_dialer = engine_dialer(config.security)
        self.server = grpc.aio.server(
            interceptors=[*self.security.interceptors(), ErrorMappingInterceptor()], options=options
        )
        self.port = self.security.add_port(self.server, f"{config.server.host}:{config.server.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {config.server.host}:{config.server.port}")
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.servicer = EngineServicer(config.model.device, self.telemetry)
        pb_grpc.add_EngineServicer_to_server(self.servicer, self.server)
        self.async_engine: AsyncEngine | None = None
        self._stop = asyncio.Event()
        self._drained = False

    @property
    def advertise_address(self) -> str:
        """Where other engines reach this one (--advertise-address; else the bound host and port, with the
        machine's host name for a wildcard host)."""
        configured = self.config.disaggregation.advertise_address
        if configured is not None:
            return configured
        host = self.config.server.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = socket.gethostname()
        return f"{host}:{self.port}"

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        log.info(
            "gRPC listening on %s:%d (%s; NOT_SERVING until the model is loaded)",
            self.config.server.host,
            self.port,
            self.security.describe(),
        )
        loop = asyncio.get_running_loop()
        try:
            self.telemetry.start_endpoint()
            core = await loop.run_in_executor(None, LLMEngine, self.config, self.workers)
        except BaseException:
            # A model that cannot load ends the process with a message: stop gRPC cleanly first.
            if self.workers is not None:
                self.workers.shutdown()
            await self.server.stop(grace=None)
            self.telemetry.shutdown()
            raise
        self.async_engine = AsyncEngine(
            core,
            on_fatal=lambda reason: loop.call_soon_threadsafe(self._fatal, reason),
            max_message_bytes=self.config.server.max_message_bytes,
            dialer=self.engine_dialer,
        )
        self.servicer.attach(self.async_engine, self.advertise_address, self.config.server.max_message_bytes)
        try:
            await warm_up(self.async_engine)
        except BaseException:
            await self.server.stop(grace=None)
            self.async_engine.shutdown()
            self.telemetry.shutdown()
            raise
        await self.telemetry.attach(self.async_engine)
        # What is alive now (the model, torch, transformers) lives as long as the process: keep the
        # garbage collector from walking it again in every full collection during serving.
        gc.freeze()
        self.servicer.ready = True
        self.telemetry.set_state("serving")
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("SERVING %s", core.model_name)

    async def drain_and_stop(self) -> None:
        """Stop taking requests, let in-flight streams finish (up to drain_seconds), then stop. Once: a
        second call returns at once (the stopped engine thread would never answer its stats)."""
        if self._drained:
            return
        self._drained = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.telemetry.set_state("draining")
        if self.async_engine is not None:
            self.async_engine.start_draining()
            deadline = asyncio.get_running_loop().time() + self.config.server.drain_seconds
            while await self._busy() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
        await self.server.stop(grace=1.0)
        if self.async_engine is not None:
            await self.async_engine.close_transport()
            self.async_engine.shutdown()
        self.telemetry.shutdown()

    async def _busy(self) -> bool:
        """Streams still running, or KV transfers produced here that a decode engine has yet to pull."""
        assert self.async_engine is not None
        if self.async_engine.num_active:
            return True
        return (await self.async_engine.stats()).kv_transfers_pending > 0

    def _reload(self) -> None:
        """SIGHUP: re-read this engine's certificate and token, and the token it presents to others."""
        self.security.reload()
        if self.engine_dialer.reload():
            log.info("SIGHUP: re-read the token presented to other engines")

    def _fatal(self, reason: str) -> None:
        self.failure = reason
        self._stop.set()

    async def stop_after_failure(self) -> None:
        """NOT_SERVING at once; the failed streams send their error (briefly); then stop everything."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _FAILED_STREAMS_GRACE_S
        while self.async_engine is not None and self.async_engine.num_active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        if self.async_engine is not None:
            self.async_engine.shutdown()
        self.telemetry.shutdown()

    async def serve(self) -> None:
        """Serve until a signal (drain, then return) or a worker failure (raises WorkerFailedError)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        await self.start()
        await self._stop.wait()
        if self.failure is not None:
            await self.stop_after_failure()
            raise WorkerFailedError(self.failure)
        log.info("signal received: draining")
        await self.drain_and_stop()
