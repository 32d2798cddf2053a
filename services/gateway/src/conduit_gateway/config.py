"""The gateway's configuration: one frozen dataclass, validated on construction.

The CLI and the CONDUIT_* environment variables map onto it in `cli.py`; nothing else reads the environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ROUTING_STRATEGIES = ("round_robin",)


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the option's name."""


def parse_engine_address(address: str) -> str:
    """Return `address` stripped, or raise ConfigError unless it reads HOST:PORT with 1 <= PORT <= 65535."""
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"engine: expected HOST:PORT with a port in [1, 65535], got {address!r}")
    return text


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway needs to run; see `cli.py` for the matching flags."""

    engines: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    routing: str = "round_robin"
    # Requests in flight at once; one more gets 429 rather than queueing in the gateway.
    max_concurrent_requests: int = 1024
    max_body_bytes: int = 8 * 1024 * 1024
    retry_after_s: int = 1
    health_interval_s: float = 2.0
    # None: generation streams have no deadline (they may legitimately run for minutes).
    request_timeout_s: float | None = None
    grpc_max_message_bytes: int = 64 * 1024 * 1024
    grpc_keepalive_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.engines:
            raise ConfigError("engine: at least one HOST:PORT is required")
        for address in self.engines:
            parse_engine_address(address)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if any(not key for key in self.api_keys):
            raise ConfigError("api_key: keys must not be empty")
        if self.routing not in ROUTING_STRATEGIES:
            raise ConfigError(
                f"routing: must be one of {', '.join(ROUTING_STRATEGIES)}, got {self.routing!r}"
            )
        _positive("max_concurrent_requests", self.max_concurrent_requests)
        _positive("max_body_bytes", self.max_body_bytes)
        _positive("grpc_max_message_bytes", self.grpc_max_message_bytes)
        if self.retry_after_s < 0:
            raise ConfigError(f"retry_after: must be >= 0, got {self.retry_after_s}")
        _positive("health_interval", self.health_interval_s)
        _positive("grpc_keepalive", self.grpc_keepalive_s)
        if self.request_timeout_s is not None:
            _positive("request_timeout", self.request_timeout_s)
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ConfigError(f"log_level: unknown level {self.log_level!r}")


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name}: must be > 0, got {value}")
