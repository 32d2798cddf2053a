"""The transport to one engine replica: a shared grpc.aio channel and the RPCs the gateway makes on it.

The channel is plaintext or TLS and every call carries the engines' bearer token, as the EngineDialer
(--engine-tls-*, --engine-auth-token-file) says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from conduit_common.engine_dialer import PLAINTEXT, EngineDialer
from conduit_gateway.config import GatewayConfig
from conduit_gateway.routing.call_reader import CallReader
from conduit_gateway.routing.generate_mux import GenerateMux, MuxCall

# What a generation is read from: its tagged request on the engine's GenerateStream, or its own call.
MessageSource = MuxCall | CallReader


def channel_options(config: GatewayConfig) -> list[tuple[str, int]]:
    """Options of every engine channel: message size limits, HTTP/2 keepalive and reconnect backoff."""
    keepalive_ms = _ms(config.grpc_keepalive_s)
    return [
        ("grpc.max_send_message_length", config.grpc_max_message_bytes),
        ("grpc.max_receive_message_length", config.grpc_max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", min(keepalive_ms, _ms(config.grpc_keepalive_timeout_s))),
        # Pings only while calls are active (the health watch is one): idle pings would make a
        # default-configured server answer GOAWAY(too_many_pings).
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after an engine restart instead of gRPC's default backoff of up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", _ms(config.reconnect_backoff_s)),
        ("grpc.max_reconnect_backoff_ms", _ms(config.max_reconnect_backoff_s)),
    ]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class EngineClient:
    """One channel to `address` and typed calls on it; it keeps no state about the engine."""

    def __init__(self, address: str, config: GatewayConfig, dialer: EngineDialer = PLAINTEXT) -> None:
        self.address = address
        self._dialer = dialer
        self._channel = dialer.dial(address, channel_options(config))
        self._engine = engine_pb2_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # Set from the engine's GetModelInfo (generate_stream) and --engine-multiplex: Generate calls
        # then share one GenerateStream (routing/generate_mux.py).
        self._mux: GenerateMux | None = None
        self._mux_unimplemented = False  # the engine said it does not serve GenerateStream after all

    def multiplex(self, on: bool, batch_bytes: int = 0) -> None:
        """Send the following Generate calls on one GenerateStream (on), or each as its own call;
        `batch_bytes`: the largest batch of actions the engine takes on it (0: none)."""
        mux = self._mux
        if on and (mux is None or mux.batch_bytes != batch_bytes) and not self._mux_unimplemented:
            self._mux = GenerateMux(self._open_generate_stream, self._unimplemented, batch_bytes)
        elif not on:
            self._mux = None
        if mux is not None and mux is not self._mux:
            mux.renew()  # its open requests finish on it, then it closes; nothing new is sent there

    def renew_streams(self) -> None:
        """The channel's credentials changed (SIGHUP re-read the engine token): requests from now on go
        on a new GenerateStream, which carries the new token; the old one ends with its requests."""
        if self._mux is not None:
            self._mux.renew()

    def _unimplemented(self) -> None:
        self._mux_unimplemented = True
        self.multiplex(False)

    @property
    def multiplexed(self) -> bool:
        return self._mux is not None

    def _open_generate_stream(
        self, requests: AsyncIterator[engine_pb2.GenerateStreamRequest]
    ) -> grpc.aio.StreamStreamCall:
        return self._engine.GenerateStream(requests, metadata=self._dialer.metadata())

    async def check(self, timeout_s: float) -> bool:
        """grpc.health.v1 Check: True when the engine says SERVING (raises AioRpcError when unreachable)."""
        reply = await self._health.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, metadata=self._dialer.metadata()
        )
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def watch(self) -> grpc.aio.UnaryStreamCall:
        """grpc.health.v1 Watch: the current status, then every change.

        wait_for_ready: while the engine is down the call waits for the channel to reconnect (with the
        channel's own backoff) instead of failing at once.
        """
        return self._health.Watch(
            health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, metadata=self._dialer.metadata()
        )

    async def model_info(self, timeout_s: float) -> engine_pb2.GetModelInfoResponse:
        return await self._engine.GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=timeout_s, metadata=self._dialer.metadata()
        )

    async def load(self, timeout_s: float) -> engine_pb2.GetLoadResponse:
        return await self._engine.GetLoad(
            engine_pb2.GetLoadRequest(), timeout=timeout_s, metadata=self._dialer.metadata()
        )

    def subscribe_kv_events(self) -> grpc.aio.UnaryStreamCall:
        """SubscribeKvEvents: the engine's cached blocks, then their changes (waits while it is down)."""
        return self._engine.SubscribeKvEvents(
            engine_pb2.SubscribeKvEventsRequest(), wait_for_ready=True, metadata=self._dialer.metadata()
        )

    async def tokenize(
        self, request: engine_pb2.TokenizeRequest, timeout_s: float
    ) -> engine_pb2.TokenizeResponse:
        return await self._engine.Tokenize(request, timeout=timeout_s, metadata=self._dialer.metadata())

    async def detokenize(
        self, request: engine_pb2.DetokenizeRequest, timeout_s: float
    ) -> engine_pb2.DetokenizeResponse:
        return await self._engine.Detokenize(request, timeout=timeout_s, metadata=self._dialer.metadata())

    def generate(
        self,
        request: engine_pb2.GenerateRequest,
        metadata: Sequence[tuple[str, str]],
        timeout_s: float | None,
    ) -> MessageSource:
        """Start `request`: on the engine's GenerateStream when multiplexed, else as its own Generate call
        (read through a CallReader); either way read alike (`read`, `next_item`, `take_ready`, `cancel`)."""
        if self._mux is not None:
            return self._mux.generate(request, metadata, timeout_s)
        call = self._engine.Generate(request, metadata=self._dialer.metadata(*metadata), timeout=timeout_s)
        return CallReader(call)

    async def abort(self, request_id: str, timeout_s: float) -> bool:
        """Abort: stop a running or waiting request; True when the engine still had it."""
        request = engine_pb2.AbortRequest(request_id=request_id)
        reply = await self._engine.Abort(request, timeout=timeout_s, metadata=self._dialer.metadata())
        return reply.aborted

    async def release_kv(self, transfer_id: str, timeout_s: float) -> bool:
        """ReleaseKv: free a prefill's pinned KV that no decode engine will pull; True when it was pending."""
        request = engine_pb2.ReleaseKvRequest(transfer_id=transfer_id)
        reply = await self._engine.ReleaseKv(request, timeout=timeout_s, metadata=self._dialer.metadata())
        return reply.released

    async def list_loras(self, timeout_s: float) -> engine_pb2.ListLoraAdaptersResponse:
        return await self._engine.ListLoraAdapters(
            engine_pb2.ListLoraAdaptersRequest(), timeout=timeout_s, metadata=self._dialer.metadata()
        )

    async def load_lora(self, name: str, path: str, timeout_s: float) -> engine_pb2.LoraAdapter:
        request = engine_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        reply = await self._engine.LoadLoraAdapter(
            request, timeout=timeout_s, metadata=self._dialer.metadata()
        )
        return reply.adapter

    async def unload_lora(self, name: str, timeout_s: float) -> None:
        request = engine_pb2.UnloadLoraAdapterRequest(lora_name=name)
        await self._engine.UnloadLoraAdapter(request, timeout=timeout_s, metadata=self._dialer.metadata())

    async def close(self) -> None:
        if self._mux is not None:
            self._mux.close()
        await self._channel.close(grace=None)
