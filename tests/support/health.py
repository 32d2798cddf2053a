"""Health probes of the tests: an engine's grpc.health.v1 status and a gateway's GET /health status code.

Each answers once and never raises for an unreachable server (None), so callers can poll it while a
process starts, drains or dies.
"""

from __future__ import annotations

import ssl

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


def engine_health(
    address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None
) -> int | None:
    """grpc.health.v1 Check of the whole server at `address` (over TLS with `credentials`): SERVING,
    NOT_SERVING, ... or None when the call fails (not listening yet, gone, timed out)."""
    with _channel(address, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return None
    return reply.status


def engine_serving(
    address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None
) -> bool:
    """True when the engine at `address` says SERVING now."""
    return engine_health(address, timeout_s, credentials) == SERVING


def gateway_health(url: str, timeout_s: float = 5.0, verify: ssl.SSLContext | bool = True) -> int | None:
    """The status code of GET `url`/health (200: an engine is SERVING, 503: none), or None when the
    gateway does not answer. `verify`: how an https `url` is checked (httpx's argument)."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s, verify=verify).status_code
    except httpx.HTTPError:
        return None
