"""The engines behind the gateway: membership from --engine, DNS and the admin API, and picking one.

Nodes are keyed by address. Removing a node (admin DELETE, or its DNS record going away) takes it out of
rotation at once; its channel closes only after this gateway's requests on it have finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection

from conduit.engine.v1 import engine_pb2
from conduit_common.engine_dialer import PLAINTEXT, EngineDialer
from conduit_gateway.config import GatewayConfig, parse_engine_address
from conduit_gateway.errors import model_not_found, no_engine_ready
from conduit_gateway.routing.discovery import DnsDiscovery, Resolver
from conduit_gateway.routing.node import EngineNode, NodeSource
from conduit_gateway.routing.prefix_key import prefix_key
from conduit_gateway.routing.selection import RouteRequest, SelectionOptions, make_selector

log = logging.getLogger(__name__)


class DuplicateNodeError(ValueError):
    """The address is already in the pool."""


class UnknownNodeError(KeyError):
    """No node has the address."""


class EnginePool:
    """Engine nodes with their health and load; `acquire` returns a routable node that serves the model."""

    def __init__(
        self, config: GatewayConfig, resolver: Resolver | None = None, dialer: EngineDialer = PLAINTEXT
    ) -> None:
        self.config = config
        self.dialer = dialer  # TLS and token towards the engines
        self._nodes: dict[str, EngineNode] = {}
        self._selector = make_selector(
            config.routing, SelectionOptions(affinity_load_factor=config.affinity_load_factor)
        )
        self._discovery = (
            DnsDiscovery(config.engine_dns, config.dns_interval_s, self.sync_dns, resolver)
            if config.engine_dns is not None
            else None
        )
        self._discovery_task: asyncio.Task[None] | None = None
        # Removed nodes whose requests are still finishing, with the task that closes them afterwards.
        self._retiring: dict[EngineNode, asyncio.Task[None]] = {}
        self._refreshing: asyncio.Future[bool] | None = None

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        for address in self.config.engines:
            self.add(address, NodeSource.STATIC)
        if self._discovery is not None:
            await self._discovery.resolve_now()
            self._discovery_task = asyncio.create_task(self._discovery.run(), name="dns-discovery")
        # The health watches report within moments; checking now means the first request finds them.
        await self.refresh()

    async def stop(self) -> None:
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery_task
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()
        for task in self._retiring.values():
            task.cancel()
        nodes = [*self._nodes.values(), *self._retiring]
        self._nodes, self._retiring = {}, {}
        await asyncio.gather(*(node.stop() for node in nodes), return_exceptions=True)

    # -- membership ----------------------------------------------------------------------------------

    @property
    def engines(self) -> list[EngineNode]:
        """Every node, in the order they joined."""
        return list(self._nodes.values())

    def node(self, address: str) -> EngineNode:
        try:
            return self._nodes[address]
        except KeyError:
            raise UnknownNodeError(address) from None

    def add(self, address: str, source: NodeSource) -> EngineNode:
        """Add and start a node (ConfigError naming `address` when it is not HOST:PORT)."""
        address = parse_engine_address(address, field="address")
        if address in self._nodes:
            raise DuplicateNodeError(address)
        node = self._nodes[address] = EngineNode(address, source, self.config, self.dialer)
        node.start()
        log.info("engine %s joined the pool (%s)", address, source)
        return node

    def remove(self, address: str) -> EngineNode:
        """Take a node out of the pool now; its open requests finish, then its channel closes."""
        node = self._nodes.pop(address, None)
        if node is None:
            raise UnknownNodeError(address)
        node.draining = True
        self._retiring[node] = asyncio.create_task(self._retire(node), name=f"retire {address}")
        log.info("engine %s left the pool (%d request(s) still finishing)", address, node.in_flight)
        return node

    async def _retire(self, node: EngineNode) -> None:
        await node.wait_idle()
        self._retiring.pop(node, None)
        await node.stop()

    def drain(self, address: str) -> EngineNode:
        """No new requests for the node; open ones finish. It stays in the pool until removed or resumed."""
        node = self.node(address)
        node.draining = True
        return node

    def resume(self, address: str) -> EngineNode:
        node = self.node(address)
        node.draining = False
        return node

    def sync_dns(self, addresses: set[str]) -> None:
        """Make the DNS-sourced nodes exactly `addresses` (nodes from other sources are left alone)."""
        for address in sorted(addresses - self._nodes.keys()):
            self.add(address, NodeSource.DNS)
        for address, node in list(self._nodes.items()):
            if node.source is NodeSource.DNS and address not in addresses:
                self.remove(address)

    # -- health --------------------------------------------------------------------------------------

    async def refresh(self) -> bool:
        """Check every node now; True when at least one can take requests (SERVING, not drained).

        Concurrent callers (probes, requests during an outage) share one round of checks.
        """
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._check_all())
        # shield: one caller giving up (e.g. its client went away) must not cancel the others' round.
        return await asyncio.shield(self._refreshing)

    async def _check_all(self) -> bool:
        await asyncio.gather(*(node.check(self.config.health_check_timeout_s) for node in self.engines))
        return bool(self.routable())

    def routable(self) -> list[EngineNode]:
        return [node for node in self._nodes.values() if node.routable]

    def served_models(self) -> dict[str, EngineNode]:
        """Model name → one routable node that serves it (the first, for its model info)."""
        models: dict[str, EngineNode] = {}
        for node in self.routable():
            if node.model is not None:
                models.setdefault(node.model, node)
        return models

    def eject(self, node: EngineNode, reason: str) -> None:
        """A request saw UNAVAILABLE: stop routing there until its health watch says SERVING again."""
        node.eject(reason)

    # -- routing -------------------------------------------------------------------------------------

    def route_request(self, model: str, request: engine_pb2.GenerateRequest) -> RouteRequest:
        return RouteRequest(model=model, prefix_key=prefix_key(request, self.config.affinity_prefix_chars))

    async def acquire(self, request: RouteRequest, exclude: Collection[EngineNode] = ()) -> EngineNode:
        """Pick a routable node for `request.model`, skipping `exclude`.

        Raises 503 when no node is ready and 404 when no node (ready or not) serves the model.
        """
        if not self.routable():
            # A just-started engine may not have reported yet.
            await self.refresh()
        ready = [node for node in self.routable() if node not in exclude]
        candidates = [node for node in ready if node.model == request.model]
        if not candidates:
            if not ready:
                raise no_engine_ready()
            if any(node.model == request.model for node in self._nodes.values()):
                raise no_engine_ready(f"no engine serving `{request.model}` is ready")
            raise model_not_found(request.model)
        return self._selector.choose(candidates, request)


def require_serving(pool: EnginePool) -> None:
    """Raise 503 unless some node is routable (for endpoints that only read cached engine state)."""
    if not pool.routable():
        raise no_engine_ready()
