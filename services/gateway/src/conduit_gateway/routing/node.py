"""One engine replica in the pool: its channel, health, load, and this gateway's traffic to it.

A node is routable while its engine says SERVING (and its model is known) and nobody drains it. It is
ejected (out of rotation, `ejections` + 1) when its health watch breaks or reports NOT_SERVING, or when a
request sees UNAVAILABLE, and it is re-admitted as soon as its health watch reports SERVING again.

An engine that says NOT_SERVING is draining: its running streams go on. One whose health watch or Check
breaks, or whose stream broke, is *lost*: `mark_lost` tells the streams open on it (`watch_lost`), so that
they move to another engine (handlers/migration.py) rather than wait on a dead or hung one.

Each node serves one pool (`role`: whole requests, or the prefill or decode side of disaggregated ones).
Before it joins the rotation its pool's admission check reads the engine's model info; a node it refuses
(a wrong engine role, a KV layout other than its peers') stays out, with the reason in `refusal`, until a
later SERVING report passes the check.

With `--routing kv_aware` each node also follows its engine's SubscribeKvEvents stream into the pool's KV
index (routing/kv_events.py); leaving the rotation makes the index forget the engine until a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable

import grpc

from conduit.engine.v1 import engine_pb2
from conduit_common.engine_dialer import PLAINTEXT, EngineDialer
from conduit_gateway.config import GatewayConfig
from conduit_gateway.routing.client import EngineClient
from conduit_gateway.routing.health import HealthWatch
from conduit_gateway.routing.kv_events import KvEventSubscriber
from conduit_gateway.routing.kv_index import KvIndex
from conduit_gateway.routing.latency import TokenLatency
from conduit_gateway.routing.load import LoadReport, poll_load
from conduit_gateway.routing.roles import NodeRole

log = logging.getLogger(__name__)

# Statuses that are the client's doing, not the engine's: they do not count as node failures.
_CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    }
)


class NodeSource(enum.StrEnum):
    """Where a node came from: --engine, DNS discovery, or the admin API."""

    STATIC = "static"
    DNS = "dns"
    ADMIN = "admin"


# Why an engine (node, its model info) may not join the node's pool; None when it may.
Admission = Callable[["EngineNode", engine_pb2.GetModelInfoResponse], str | None]


class EngineNode:
    """State of one engine as the router sees it. Made and used on the gateway's event loop (its grpc.aio
    channel belongs to the loop it was created on)."""

    def __init__(
        self,
        address: str,
        source: NodeSource,
        config: GatewayConfig,
        dialer: EngineDialer = PLAINTEXT,
        role: NodeRole = NodeRole.COLOCATED,
        admission: Admission | None = None,
        kv_index: KvIndex | None = None,
    ) -> None:
        self.address = address
        self.kv_index = kv_index  # the pool's, when routing follows the engines' KV events
        self.kv_events: KvEventSubscriber | None = None
        self.source = source
        self.role = role
        self._admission = admission
        self.refusal: str | None = None  # why the pool's admission check keeps the engine out
        self._config = config
        self.client = EngineClient(address, config, dialer)
        self.serving = False
        self.draining = False
        self.model_info: engine_pb2.GetModelInfoResponse | None = None
        # When model_info was first fetched: the `created` of the model in GET /v1/models.
        self.model_seen_at = 0
        self.load: LoadReport | None = None
        # LoRA adapters it serves (name → where from): ListLoraAdapters when it starts serving, then each
        # GetLoad's names and the loads and unloads the gateway makes (routing/lora.py).
        self.lora_adapters: dict[str, str] = {}
        self.in_flight = 0
        self.active_blocks = 0  # KV blocks of this gateway's requests open on the node (prompt blocks)
        self._changed_at = 0.0  # when one of them started or ended (monotonic)
        self._load_at = 0.0  # when the last GetLoad answer arrived
        self.routed = 0
        self.failures = 0
        self.ejections = 0
        self._latency = TokenLatency()
        self._health: HealthWatch | None = None
        self._last_check_failure: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._transition = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
        self._lost_watchers: set[Callable[[str], None]] = set()

    # -- what routing reads --------------------------------------------------------------------------

    @property
    def model(self) -> str | None:
        return self.model_info.model if self.model_info is not None else None

    @property
    def routable(self) -> bool:
        return self.serving and not self.draining

    @property
    def load_score(self) -> int:
        """Requests at the node: this gateway's own count (exact, immediate), or the engine's running +
        waiting from its last GetLoad when that is larger (other gateways and clients use it too)."""
        reported = self.load.running + self.load.waiting if self.load is not None else 0
        return max(self.in_flight, reported)

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block of the engine (from its model info)."""
        return self.model_info.block_size if self.model_info is not None else None

    @property
    def kv_active_blocks(self) -> int:
        """KV blocks the engine's live sequences hold: its last GetLoad when that answer is newer than this
        gateway's last request start or end there (then it saw them), else this gateway's own count, which
        is exact and immediate (a polled number would make an engine look busy right after a request)."""
        reported = self.load.kv_blocks_used if self.load is not None else 0
        if self._load_at <= self._changed_at:
            reported = 0
        return max(self.active_blocks, reported)

    @property
    def indexed_blocks(self) -> int | None:
        """Blocks of the engine in the KV index; None without an index or while its snapshot is not in."""
        return self.kv_index.indexed_blocks(self.address) if self.kv_index is not None else None

    @property
    def token_latency_s(self) -> float | None:
        return self._latency.value

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        if self.serving:
            return "serving"
        return "refused" if self.refusal is not None else "unavailable"

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start following health and load."""
        config = self._config
        self._health = HealthWatch(
            self.address,
            self.client.watch,
            self.set_health,
            config.reconnect_backoff_s,
            config.health_interval_s,
            on_broken=self.mark_lost,
        )
        load = poll_load(
            self.address,
            lambda: self.serving,
            self.client.load,
            self._set_load,
            config.load_interval_s,
            config.load_timeout_s,
        )
        self._tasks = [
            asyncio.create_task(self._health.run(), name=f"health-watch {self.address}"),
            asyncio.create_task(load, name=f"load-poll {self.address}"),
        ]
        if self.kv_index is not None:
            self.kv_events = KvEventSubscriber(
                self.address,
                self.client.subscribe_kv_events,
                self.kv_index,
                config.reconnect_backoff_s,
                config.max_reconnect_backoff_s,
            )
            self._tasks.append(asyncio.create_task(self.kv_events.run(), name=f"kv-events {self.address}"))

    async def stop(self) -> None:
        """Stop the background tasks and close the channel (cancelling any call still open on it)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.serving = False
        if self.kv_index is not None:
            self.kv_index.remove(self.address)
        await self.client.close()

    async def wait_idle(self) -> None:
        """Return once no request of this gateway is open on the node."""
        await self._idle.wait()

    # -- health --------------------------------------------------------------------------------------

    async def check(self, timeout_s: float) -> bool:
        """Ask grpc.health.v1 Check now (for probes that want the current state, not the last push)."""
        try:
            serving = await self.client.check(timeout_s)
        except grpc.aio.AioRpcError as exc:
            failure = f"health check failed: {exc.code().name}: {exc.details()}"
            if failure != self._last_check_failure:
                # Once per distinct failure: a TLS or token misconfiguration must be visible, not a flood.
                log.warning("engine %s %s", self.address, failure)
                self._last_check_failure = failure
            self.mark_lost(f"health check failed: {exc.code().name}")
            return False
        self._last_check_failure = None
        if serving:
            await self.set_health(True)
        else:
            self.eject("health check says NOT_SERVING")
        return self.serving

    def _set_load(self, report: LoadReport | None) -> None:
        self.load = report
        self._load_at = time.monotonic()
        if report is not None:  # adapters loaded or unloaded there by others; new ones' paths unknown
            self.lora_adapters = {n: self.lora_adapters.get(n, "") for n in report.lora_adapters}

    async def set_health(self, serving: bool) -> None:
        """Apply a health report; on the way into SERVING fetch the model info first (a restarted engine
        may serve another model or other limits), and stay out if that fails."""
        async with self._transition:
            if serving and not self.serving:
                try:
                    self.model_info = await self.client.model_info(self._config.model_info_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    log.warning("engine %s GetModelInfo failed: %s", self.address, exc.code().name)
                    return
                # Its generations share one GenerateStream where it serves one (routing/generate_mux.py).
                info = self.model_info
                self.client.multiplex(
                    self._config.engine_multiplex and info.generate_stream, info.generate_stream_batch_bytes
                )
                await self._read_adapters()
                # No await between admission and SERVING: two engines of a disaggregated pool coming up
                # at once each see the other admitted, so layouts that differ are always refused.
                if not self._admit(self.model_info):
                    return
                self.model_seen_at = int(time.time())
                self.serving = True
                log.info("engine %s is SERVING %s", self.address, self.model)
            elif not serving:
                self._leave_rotation("stopped serving")

    async def _read_adapters(self) -> None:
        """The LoRA adapters it serves now (none from an engine without them or without the RPC)."""
        try:
            listed = await self.client.list_loras(self._config.model_info_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                log.warning("engine %s ListLoraAdapters failed: %s", self.address, exc.code().name)
            self.lora_adapters = {}
            return
        self.lora_adapters = {a.name: a.path for a in listed.adapters}

    def _admit(self, info: engine_pb2.GetModelInfoResponse) -> bool:
        """Run the pool's admission check; a refusal is logged once per new reason."""
        problem = self._admission(self, info) if self._admission is not None else None
        if problem is not None and problem != self.refusal:
            log.error("%s engine %s refused: %s", self.role, self.address, problem)
        self.refusal = problem
        return problem is None

    def eject(self, reason: str) -> None:
        """Out of rotation until a fresh health watch says SERVING (for news from outside the watch: a
        request that saw UNAVAILABLE, a failed Check)."""
        self._leave_rotation(reason)
        if self._health is not None:
            self._health.rewatch()

    def mark_lost(self, reason: str) -> None:
        """The engine is gone or hung (not draining): eject it and tell every stream open on it."""
        self.eject(reason)
        for watcher in list(self._lost_watchers):
            watcher(reason)

    def watch_lost(self, watcher: Callable[[str], None]) -> None:
        """Call `watcher(reason)` if the node is lost while the caller's stream is open."""
        self._lost_watchers.add(watcher)

    def unwatch_lost(self, watcher: Callable[[str], None]) -> None:
        self._lost_watchers.discard(watcher)

    def _leave_rotation(self, reason: str) -> None:
        if self.serving:
            self.serving = False
            self.ejections += 1
            log.warning("engine %s ejected: %s", self.address, reason)
            if self.kv_events is not None:
                self.kv_events.restart()  # what it caches is unknown until a fresh snapshot

    # -- this gateway's requests ---------------------------------------------------------------------

    def request_started(self, blocks: int = 0) -> None:
        """One of this gateway's requests opens on the node; `blocks`: its prompt's KV blocks (kv_aware)."""
        self.routed += 1
        self.in_flight += 1
        self.active_blocks += blocks
        self._changed_at = time.monotonic()
        self._idle.clear()

    def request_ended(self, blocks: int = 0) -> None:
        self.in_flight -= 1
        self.active_blocks -= blocks
        self._changed_at = time.monotonic()
        if self.in_flight == 0:
            self._idle.set()

    def request_failed(self, code: grpc.StatusCode) -> None:
        """Count an engine-side failure (client errors and cancellations are not the node's fault)."""
        if code not in _CLIENT_ERRORS:
            self.failures += 1

    def record_kv_prediction(self, predicted_blocks: int, cached_tokens: int) -> None:
        """The engine's first message says how many prompt tokens it served from its cache; compare them
        with the blocks kv_aware predicted it had."""
        if self.kv_index is not None and self.block_size:
            self.kv_index.engine(self.address).record_prediction(
                predicted_blocks, cached_tokens // self.block_size
            )

    def record_decode(self, seconds: float, tokens: int) -> None:
        """A stream finished: `tokens` generated after its first message took `seconds`."""
        self._latency.record(seconds, tokens)
