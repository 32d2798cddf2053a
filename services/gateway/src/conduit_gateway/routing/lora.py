"""LoRA adapters across the engines: which serve which adapter, routing a request whose model is an adapter
(to an engine that has it loaded, LoRA affinity; else to the least loaded engine of its base model, which
loads it first), and loading or unloading an adapter on every engine of its base model.

An engine's adapters come from ListLoraAdapters when it starts serving, its GetLoad answers and the loads
this gateway makes (routing/node.py: `lora_adapters`, name → the folder or Hub id it came from). An adapter
loaded on no engine is not served here: the gateway keeps no registry of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from conduit_gateway.errors import from_rpc_error, no_engine_ready
from conduit_gateway.routing.node import EngineNode

log = logging.getLogger(__name__)

# A load reads the adapter (from the Hub, maybe) and checks it against the model: seconds, not a GetLoad's.
LORA_LOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class AdapterView:
    """One adapter as the pool sees it: its base model, where it comes from, the engines that have it."""

    name: str
    parent: str
    path: str
    nodes: tuple[EngineNode, ...]


def adapters(nodes: Sequence[EngineNode]) -> dict[str, AdapterView]:
    """Every adapter loaded on one of `nodes` (routable ones, for routing and /v1/models)."""
    found: dict[str, AdapterView] = {}
    for node in nodes:
        if node.model is None:
            continue
        for name, path in node.lora_adapters.items():
            seen = found.get(name)
            if seen is None:
                found[name] = AdapterView(name, node.model, path, (node,))
            else:
                found[name] = AdapterView(name, seen.parent, seen.path or path, (*seen.nodes, node))
    return found


class LoraLoader:
    """Loads adapters on engines, one load per (engine, adapter) at a time however many requests wait."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: dict[tuple[str, str], asyncio.Future[None]] = {}

    async def ensure(self, node: EngineNode, name: str, path: str) -> None:
        """`name` loaded on `node` (raises AioRpcError when the engine refuses)."""
        if name in node.lora_adapters:
            return
        key = (node.address, name)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._load(node, name, path))
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        await asyncio.shield(pending)

    async def _load(self, node: EngineNode, name: str, path: str) -> None:
        try:
            await node.client.load_lora(name, path, self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.INVALID_ARGUMENT or "already loaded" not in (
                exc.details() or ""
            ):
                raise
        node.lora_adapters[name] = path
        log.info("LoRA adapter %s loaded on %s from %s", name, node.address, path)


Choose = Callable[[list[EngineNode]], EngineNode]


async def acquire_adapter(
    loader: LoraLoader, known: Sequence[EngineNode], ready: list[EngineNode], name: str, choose: Choose
) -> EngineNode | None:
    """The engine for a request whose model is adapter `name`, or None when no engine of `known` (ready or
    not: a drained engine still tells where an adapter comes from) has it.

    Among the ready engines that have it loaded, the strategy (`choose`) picks; when none has it, the
    least loaded engine of its base model loads it (the next one when that one refuses)."""
    view = adapters(known).get(name)
    if view is None:
        return None
    return await _acquire(loader, ready, view, choose)


async def _acquire(
    loader: LoraLoader, ready: list[EngineNode], view: AdapterView, choose: Choose
) -> EngineNode:
    loaded = [node for node in view.nodes if node in ready]
    if loaded:
        return choose(loaded)
    base = sorted((n for n in ready if n.model == view.parent), key=lambda n: n.load_score)
    if not base:
        raise no_engine_ready(f"no engine serving `{view.parent}` (the base of `{view.name}`) is ready")
    if not view.path:  # known only from load reports: where it comes from is not known here
        raise no_engine_ready(f"no engine that has LoRA adapter `{view.name}` loaded is ready")
    failure: grpc.aio.AioRpcError | None = None
    for node in base:
        try:
            await loader.ensure(node, view.name, view.path)
            return node
        except grpc.aio.AioRpcError as exc:
            log.warning("engine %s refused LoRA adapter %s: %s", node.address, view.name, exc.details())
            failure = exc
    assert failure is not None
    raise from_rpc_error(failure, 1) from None
