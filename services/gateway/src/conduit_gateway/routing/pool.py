"""The engines behind the gateway: membership from --engine, DNS and the admin API, and picking one.

Nodes are keyed by address. Removing a node (admin DELETE, or its DNS record going away) takes it out of
rotation at once; its channel closes only after this gateway's requests on it have finished.

Each node serves one pool (its `role`): whole requests (--engine), or the prefill or decode side of
disaggregated requests (--prefill-engine, --decode-engine); an address belongs to one pool. `--routing`
picks within a pool: each has its own selector. A prefill or decode engine joins only when its role
covers the pool and its KV layout equals the other disaggregated engines' of its model; at start a static
engine refused that way stops the gateway with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection

import grpc

from conduit.engine.v1 import engine_pb2
from conduit_common.engine_dialer import PLAINTEXT, EngineDialer
from conduit_gateway.config import ConfigError, GatewayConfig, parse_engine_address
from conduit_gateway.errors import model_not_found, no_engine_ready
from conduit_gateway.routing.discovery import DnsDiscovery, Resolver
from conduit_gateway.routing.kv_index import KvIndex
from conduit_gateway.routing.lora import LORA_LOAD_TIMEOUT_S, LoraLoader, acquire_adapter, adapters
from conduit_gateway.routing.node import EngineNode, NodeSource
from conduit_gateway.routing.prefix_key import prefix_key
from conduit_gateway.routing.roles import NodeRole, admission_problem
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
        # Nodes the admin API added are not the operator's: the token goes to them only over TLS that
        # verifies them against the engines' CA; over plain gRPC they are dialled without it.
        self.admin_dialer = dialer if dialer.secure else PLAINTEXT
        self._nodes: dict[str, EngineNode] = {}
        # kv_aware: one index of every engine's cached blocks, fed by their SubscribeKvEvents streams.
        self.kv_index = KvIndex(config.kv_index_max_blocks) if config.routing == "kv_aware" else None
        options = SelectionOptions(
            affinity_load_factor=config.affinity_load_factor,
            kv_index=self.kv_index,
            kv_overlap_weight=config.kv_overlap_weight,
            router_temperature=config.router_temperature,
        )
        self._selectors = {role: make_selector(config.routing, options) for role in NodeRole}
        self._static = {
            NodeRole.COLOCATED: config.engines,
            NodeRole.PREFILL: config.prefill_engines,
            NodeRole.DECODE: config.decode_engines,
        }
        dns = {
            NodeRole.COLOCATED: config.engine_dns,
            NodeRole.PREFILL: config.prefill_engine_dns,
            NodeRole.DECODE: config.decode_engine_dns,
        }
        self._discoveries = [
            DnsDiscovery(target, config.dns_interval_s, self._dns_sync_for(role), resolver)
            for role, target in dns.items()
            if target is not None
        ]
        self._discovery_tasks: list[asyncio.Task[None]] = []
        # Removed nodes whose requests are still finishing, with the task that closes them afterwards.
        self._retiring: dict[EngineNode, asyncio.Task[None]] = {}
        self._refreshing: asyncio.Future[bool] | None = None
        self.lora_loader = LoraLoader(LORA_LOAD_TIMEOUT_S)

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Add the static nodes, resolve the DNS names, and check every node once. Raises ConfigError when
        a static prefill or decode engine is refused (wrong role, or a KV layout other than its peers')."""
        for role, addresses in self._static.items():
            for address in addresses:
                self.add(address, NodeSource.STATIC, role)
        for discovery in self._discoveries:
            await discovery.resolve_now()
            self._discovery_tasks.append(asyncio.create_task(discovery.run(), name="dns-discovery"))
        # The health watches report within moments; checking now means the first request finds them.
        await self.refresh()
        refused = [n for n in self._nodes.values() if n.source is NodeSource.STATIC and n.refusal]
        if refused:
            raise ConfigError(
                "; ".join(f"{node.role}_engine: {node.address} refused: {node.refusal}" for node in refused)
            )

    async def stop(self) -> None:
        for task in self._discovery_tasks:
            task.cancel()
        for task in self._discovery_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
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

    def add(self, address: str, source: NodeSource, role: NodeRole = NodeRole.COLOCATED) -> EngineNode:
        """Add and start a node of the `role` pool (ConfigError naming `address` when it is not HOST:PORT)."""
        address = parse_engine_address(address, field="address")
        if address in self._nodes:
            raise DuplicateNodeError(address)
        dialer = self.admin_dialer if source is NodeSource.ADMIN else self.dialer
        if dialer is not self.dialer and self.dialer.token is not None:
            log.warning(
                "engine %s is dialled without the engine token (an admin node over plain gRPC)", address
            )
        node = EngineNode(address, source, self.config, dialer, role, self._admission, self.kv_index)
        self._nodes[address] = node
        node.start()
        log.info("engine %s joined the %s pool (%s)", address, role, source)
        return node

    def _admission(self, node: EngineNode, info: engine_pb2.GetModelInfoResponse) -> str | None:
        peers = [peer for peer in self._nodes.values() if peer is not node and peer.serving]
        return admission_problem(node.role, info, peers)

    def count(self, source: NodeSource) -> int:
        """Nodes from one source (in the pool; removed ones still finishing are not counted)."""
        return sum(node.source is source for node in self._nodes.values())

    def members(self, role: NodeRole) -> list[EngineNode]:
        """The nodes of one pool, routable or not."""
        return [node for node in self._nodes.values() if node.role is role]

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

    def sync_dns(self, addresses: set[str], role: NodeRole = NodeRole.COLOCATED) -> None:
        """Make the DNS-sourced nodes of the `role` pool exactly `addresses` (nodes from other sources or
        of other pools are left alone; an address another pool holds is skipped)."""
        for address in sorted(addresses - self._nodes.keys()):
            self.add(address, NodeSource.DNS, role)
        for address in sorted(addresses & self._nodes.keys()):
            if self._nodes[address].role is not role:
                log.warning(
                    "DNS lists %s as a %s engine, but it is in the %s pool",
                    address,
                    role,
                    self._nodes[address].role,
                )
        for address, node in list(self._nodes.items()):
            if node.source is NodeSource.DNS and node.role is role and address not in addresses:
                self.remove(address)

    def _dns_sync_for(self, role: NodeRole) -> Callable[[set[str]], None]:
        return lambda addresses: self.sync_dns(addresses, role)

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

    def routable(self, role: NodeRole | None = None) -> list[EngineNode]:
        """Nodes that take requests now, of one pool or of all."""
        return [node for node in self._nodes.values() if node.routable and role in (None, node.role)]

    def served_models(self) -> dict[str, EngineNode]:
        """Model name → one routable node that serves it (the first, for its model info)."""
        models: dict[str, EngineNode] = {}
        for node in self.routable():
            if node.model is not None:
                models.setdefault(node.model, node)
        return models

    def serving_node(self, model: str) -> EngineNode | None:
        """A routable node serving `model`, a base model or a LoRA adapter (an adapter shares its base
        model's tokenizer and limits): for the model's info and tokenization."""
        node = self.served_models().get(model)
        if node is None:
            view = adapters(self.routable()).get(model)
            node = view.nodes[0] if view is not None else None
        return node

    def eject(self, node: EngineNode, reason: str) -> None:
        """A request saw UNAVAILABLE: stop routing there until its health watch says SERVING again."""
        node.eject(reason)

    # -- routing -------------------------------------------------------------------------------------

    async def route_request(
        self, model: str, request: engine_pb2.GenerateRequest, role: NodeRole = NodeRole.COLOCATED
    ) -> RouteRequest:
        """What the strategy may know of `request`; for kv_aware its token ids, asked of an engine of the
        pool that serves `model` (Tokenize: the same tokenization as Generate). Without an answer the
        request is routed by load alone."""
        key = prefix_key(request, self.config.affinity_prefix_chars)
        token_ids = None
        if self.kv_index is not None:
            token_ids = await self._token_ids(model, request, role)
        return RouteRequest(model=model, prefix_key=key, token_ids=token_ids)

    async def _token_ids(
        self, model: str, request: engine_pb2.GenerateRequest, role: NodeRole
    ) -> tuple[int, ...] | None:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            return tuple(request.token_ids.ids)
        tokenize = engine_pb2.TokenizeRequest(ids_only=True)
        if kind == "text":
            tokenize.text = request.text
        elif kind == "chat":
            tokenize.chat.CopyFrom(request.chat)
        else:
            return None
        serving = [node for node in self.routable(role) if node.model == model]
        # The least busy engine tokenizes: Tokenize runs on an engine's event loop, beside its streams.
        for node in sorted(serving, key=lambda node: node.in_flight)[:1]:
            try:
                return tuple((await node.client.tokenize(tokenize, self.config.load_timeout_s)).token_ids)
            except grpc.aio.AioRpcError as exc:
                log.info("Tokenize on %s failed (%s): routing by load", node.address, exc.code().name)
                return None
        return None

    async def acquire(
        self,
        request: RouteRequest,
        exclude: Collection[EngineNode] = (),
        role: NodeRole = NodeRole.COLOCATED,
    ) -> EngineNode:
        """Pick a routable node of the `role` pool for `request.model`, skipping `exclude`.

        A model that is a LoRA adapter goes to a node that has it loaded, else to the least loaded node of
        its base model, which loads it first (routing/lora.py).
        Raises 503 when no node is ready and 404 when no node (ready or not) serves the model.
        """
        if not self.routable(role):
            # A just-started engine may not have reported yet.
            await self.refresh()
        ready = [node for node in self.routable(role) if node not in exclude]
        candidates = [node for node in ready if node.model == request.model]
        if not candidates:
            selector = self._selectors[role]
            adapter_node = await acquire_adapter(
                self.lora_loader,
                self.engines,
                ready,
                request.model,
                lambda nodes: selector.choose(nodes, request),
            )
            if adapter_node is not None:
                return adapter_node
            pool = "" if role is NodeRole.COLOCATED else f"{role} "
            if not ready:
                raise no_engine_ready(f"no {pool}engine is ready")
            if any(node.model == request.model for node in self.members(role)):
                raise no_engine_ready(f"no {pool}engine serving `{request.model}` is ready")
            raise model_not_found(request.model)
        return self._selectors[role].choose(candidates, request)


def require_serving(pool: EnginePool) -> None:
    """Raise 503 unless some node is routable (for endpoints that only read cached engine state)."""
    if not pool.routable():
        raise no_engine_ready()
