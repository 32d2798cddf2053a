"""The state one gateway app shares across requests: configuration, engines, keys, limiters and metrics.

Made once per app; `reload()` (SIGHUP) re-reads what may rotate while the gateway runs: the keys file,
the engines' token, and (through `reload_hooks`, which the server adds) the HTTPS certificate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from conduit_common.engine_dialer import EngineDialer
from conduit_common.secret_files import SecretFileError
from conduit_gateway.config import GatewayConfig
from conduit_gateway.http.limits import ConcurrencyLimiter
from conduit_gateway.http.metrics import GatewayMetrics
from conduit_gateway.keys.keys_file import KeysFileError
from conduit_gateway.keys.rate_limit import Clock, RateLimiter
from conduit_gateway.keys.shared_limits import SharedLimitStates
from conduit_gateway.keys.store import ApiKeyStore
from conduit_gateway.routing.discovery import Resolver
from conduit_gateway.routing.pool import EnginePool
from conduit_gateway.workers.admin_log import AdminLog
from conduit_gateway.workers.metrics_peers import MetricsPeers
from conduit_gateway.workers.slot import WorkerSlot

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GatewayContext:
    config: GatewayConfig
    pool: EnginePool
    limiter: ConcurrencyLimiter
    metrics: GatewayMetrics
    api_keys: ApiKeyStore
    admin_keys: ApiKeyStore
    rate_limiter: RateLimiter
    reload_hooks: list[Callable[[], None]] = field(default_factory=list)
    # Names of the keys whose `priority` was ignored (each is logged once).
    priority_ignored: set[str] = field(default_factory=set)
    # Requests the client left, draining their engine streams to charge them exactly (handlers/drain.py).
    drains: set[asyncio.Task[None]] = field(default_factory=set)
    # --workers N: which worker this is, and what it shares with the others (None: the only process).
    worker: WorkerSlot | None = None
    admin_log: AdminLog | None = None
    metrics_peers: MetricsPeers | None = None

    @classmethod
    def create(
        cls,
        config: GatewayConfig,
        resolver: Resolver | None = None,
        clock: Clock = time.monotonic,
        worker: WorkerSlot | None = None,
    ) -> GatewayContext:
        """Reads the keys file and the engines' TLS and token files now (KeysFileError or
        SecretFileError naming the flag). `resolver` replaces DNS lookups for --engine-dns and `clock`
        the rate limits' time source (tests inject both); `worker`: this is one of --workers N."""
        dialer = EngineDialer.from_flags(
            ca=config.engine_tls_ca,
            cert=config.engine_tls_cert,
            key=config.engine_tls_key,
            server_name=config.engine_tls_server_name,
            token_file=config.engine_auth_token_file,
        )
        api_keys = ApiKeyStore(config.api_keys, config.api_keys_file)
        admin_keys = ApiKeyStore(config.admin_keys, prefix="admin-key")
        if {k.digest for k in api_keys.keys} & {k.digest for k in admin_keys.keys}:
            raise KeysFileError("--api-keys-file: holds an admin key (an API key must not grant admin)")
        pool = EnginePool(config, resolver=resolver, dialer=dialer)
        metrics = GatewayMetrics(nodes=lambda: pool.engines)
        limiter = ConcurrencyLimiter(config.max_concurrent_requests)
        if worker is None:
            rate_limiter = RateLimiter(clock)
            return cls(config, pool, limiter, metrics, api_keys, admin_keys, rate_limiter)
        states = SharedLimitStates(worker.limits_path, worker.index)
        states.clear_worker()  # the requests of the worker this one replaces are gone
        return cls(
            config,
            pool,
            limiter,
            metrics,
            api_keys,
            admin_keys,
            RateLimiter(clock, states),
            worker=worker,
            admin_log=AdminLog(worker.admin_log_path, pool),
            metrics_peers=MetricsPeers(worker, metrics.render),
        )

    def reload(self) -> None:
        """SIGHUP: each source that fails keeps what is in force and says why in the log."""
        if self.api_keys.reload():
            self.rate_limiter.forget_others({key.name for key in self.api_keys.keys})
        try:
            if self.pool.dialer.reload():
                log.info("SIGHUP: the engines' auth token changed")
                for node in self.pool.engines:
                    node.client.renew_streams()  # a GenerateStream carries the token it opened with
        except SecretFileError as exc:
            log.error("SIGHUP: keeping the engines' auth token: %s", exc)
        for hook in self.reload_hooks:
            try:
                hook()
            except (OSError, ValueError) as exc:
                log.error("SIGHUP: %s", exc)
