"""The engine process around the gRPC service: the grpc.aio server with health and reflection, loading and
warm-up (health NOT_SERVING until both are done), SIGUSR1 leaving rotation, SIGTERM drain (streams still
running when it ends are handed back with FINISH_REASON_MIGRATE), SIGHUP reload, and a worker failure.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from conduit.engine.v1 import engine_pb2_grpc as pb_grpc
from conduit_engine.config import EngineConfig
from conduit_engine.engine.async_engine import AsyncEngine
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.entrypoints.grpc_service import SERVICE_NAME, EngineServicer, ErrorMappingInterceptor
from conduit_engine.entrypoints.security import ServerSecurity, engine_dialer
from conduit_engine.errors import EngineError, WorkerFailedError
from conduit_engine.models.facts import request_bytes_limit
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.telemetry import EngineTelemetry

log = logging.getLogger(__name__)


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


def receive_limit(config: EngineConfig) -> int:
    """The largest message the engine's server accepts: what the longest prompt that fits the context
    needs (Generate and Tokenize are the only large requests; KV travels in PullKv's answers, bounded by
    --grpc-max-message-bytes), and never more than --grpc-max-message-bytes."""
    configured = config.server.max_message_bytes
    needed = request_bytes_limit(config)
    limit = configured if needed is None else min(configured, needed)
    log.info("gRPC requests up to %d bytes (--grpc-max-message-bytes %d)", limit, configured)
    return limit


# After a worker failure: how long the failed streams get to send their error before gRPC stops.
_FAILED_STREAMS_GRACE_S = 2.0
# After the drain: how long the streams handed back get to send their MIGRATE messages before gRPC stops.
_HAND_BACK_GRACE_S = 2.0


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
        self.workers = None
        if parallel.uses_workers:  # torch and the worker code load only for this configuration
            from conduit_engine.executor.worker_group import WorkerGroup

            self.workers = WorkerGroup(parallel.tensor_parallel_size)
        self.failure: str | None = None
        # After the workers: an OTLP exporter opens a gRPC channel.
        self.telemetry = EngineTelemetry(config.telemetry, config.server.host, tracer_provider)
        self.health = health.aio.HealthServicer()
        server = config.server
        receive_bytes = receive_limit(config)
        options = [
            ("grpc.max_send_message_length", server.max_message_bytes),
            ("grpc.max_receive_message_length", receive_bytes),
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
        self.servicer.token = self.security.token
        self.servicer.receive_bytes = receive_bytes
        pb_grpc.add_EngineServicer_to_server(self.servicer, self.server)
        self.async_engine: AsyncEngine | None = None
        self._stop = asyncio.Event()
        self._drained = False
        self._rotation_task: asyncio.Future[None] | None = None

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
        """Stop taking requests, let in-flight streams finish (up to drain_seconds), hand the rest back
        (FINISH_REASON_MIGRATE: the gateway continues them elsewhere), then stop. Once: a second call
        returns at once (the stopped engine thread would never answer its stats)."""
        if self._drained:
            return
        self._drained = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.telemetry.set_state("draining")
        if self.async_engine is not None:
            self.async_engine.start_draining()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.server.drain_seconds
            while loop.time() < deadline and await self._busy():
                await asyncio.sleep(0.1)
            if self.async_engine.num_active:
                log.info("drain time is up: handing %d stream(s) back", self.async_engine.num_active)
                self.async_engine.migrate_all()
                deadline = loop.time() + _HAND_BACK_GRACE_S
                while self.async_engine.num_active and loop.time() < deadline:
                    await asyncio.sleep(0.02)
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

    def _leave_rotation(self) -> None:
        """SIGUSR1 (a pre-stop hook, before SIGTERM): health says NOT_SERVING, so routers stop sending
        requests here, while the engine still serves what reaches it and its running streams go on."""
        log.info("SIGUSR1: health NOT_SERVING (leaving rotation; requests are still served until SIGTERM)")
        self._rotation_task = asyncio.ensure_future(
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        )

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
        loop.add_signal_handler(signal.SIGUSR1, self._leave_rotation)
        await self.start()
        await self._stop.wait()
        if self.failure is not None:
            await self.stop_after_failure()
            raise WorkerFailedError(self.failure)
        log.info("signal received: draining")
        await self.drain_and_stop()
