"""The state one gateway app shares across requests: configuration, engines, limiter and metrics."""

from __future__ import annotations

from dataclasses import dataclass

from conduit_gateway.config import GatewayConfig
from conduit_gateway.http.limits import ConcurrencyLimiter
from conduit_gateway.http.metrics import GatewayMetrics
from conduit_gateway.routing.discovery import Resolver
from conduit_gateway.routing.pool import EnginePool


@dataclass(slots=True)
class GatewayContext:
    config: GatewayConfig
    pool: EnginePool
    limiter: ConcurrencyLimiter
    metrics: GatewayMetrics

    @classmethod
    def create(cls, config: GatewayConfig, resolver: Resolver | None = None) -> GatewayContext:
        """`resolver` replaces DNS lookups for --engine-dns (tests inject one)."""
        pool = EnginePool(config, resolver=resolver)
        metrics = GatewayMetrics(nodes=lambda: pool.engines)
        return cls(config, pool, ConcurrencyLimiter(config.max_concurrent_requests), metrics)
