"""One engine replica as the gateway sees it: a shared grpc.aio channel, its stubs, health and model info."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from conduit_gateway.config import GatewayConfig

log = logging.getLogger(__name__)


def channel_options(config: GatewayConfig) -> list[tuple[str, int]]:
    """Options of every engine channel: HTTP/2 keepalive and message size limits."""
    keepalive_ms = int(config.grpc_keepalive_s * 1000)
    return [
        ("grpc.max_send_message_length", config.grpc_max_message_bytes),
        ("grpc.max_receive_message_length", config.grpc_max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", min(keepalive_ms, 10_000)),
        # Pings only while calls are active: idle pings would make a default-configured server answer
        # GOAWAY(too_many_pings); the health poll keeps idle connections exercised instead.
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after an engine restart instead of backing off for up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


class EngineClient:
    """A connection to one engine; `serving` and `model_info` hold what its last health check saw."""

    def __init__(self, address: str, config: GatewayConfig) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=channel_options(config))
        self.stub = engine_pb2_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.serving = False
        self.model_info: engine_pb2.GetModelInfoResponse | None = None
        # When model_info was first fetched: the `created` of the model in GET /v1/models.
        self.model_seen_at = 0

    @property
    def model(self) -> str | None:
        return self.model_info.model if self.model_info is not None else None

    async def check(self, timeout_s: float) -> bool:
        """Ask grpc.health.v1 whether the engine is SERVING; fetch model info on the way into SERVING."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving and not self.serving:
                # (Re)started engine: its model or limits may have changed.
                self.model_info = await self.stub.GetModelInfo(
                    engine_pb2.GetModelInfoRequest(), timeout=timeout_s
                )
                self.model_seen_at = int(time.time())
        except grpc.aio.AioRpcError as exc:
            if self.serving:
                log.warning("engine %s is not reachable: %s", self.address, exc.code().name)
            serving = False
        if serving != self.serving:
            log.info("engine %s %s", self.address, "is SERVING" if serving else "stopped serving")
        self.serving = serving
        return serving

    def generate(
        self,
        request: engine_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, str]],
        timeout_s: float | None,
    ) -> grpc.aio.UnaryStreamCall:
        return self.stub.Generate(request, metadata=tuple(metadata), timeout=timeout_s)

    async def close(self) -> None:
        await self._channel.close(grace=None)
