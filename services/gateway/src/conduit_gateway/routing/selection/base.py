"""The one interface every routing strategy implements, what it may read of a node, and the registry."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from conduit_gateway.routing.kv_index import KvIndex

_REGISTRY: dict[str, type[EngineSelector]] = {}


class RoutableNode(Protocol):
    """What strategies read of an engine node (EngineNode implements it; unit tests use plain objects)."""

    @property
    def address(self) -> str: ...

    @property
    def in_flight(self) -> int:
        """Requests this gateway has open on the node right now (exact, updated as they start and end)."""

    @property
    def load_score(self) -> int:
        """Requests at the node: the larger of `in_flight` and the engine's running + waiting (polled)."""

    @property
    def token_latency_s(self) -> float | None:
        """Recent seconds per generated token observed on the node's streams; None before any."""

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block of the engine; None before its model info is known."""

    @property
    def kv_active_blocks(self) -> int:
        """KV blocks the engine's live sequences hold (its GetLoad, or this gateway's own count)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a strategy may know about the request being routed."""

    model: str
    # The prompt's leading text or token ids (bytes), for prefix affinity; empty when unknown.
    prefix_key: bytes = b""
    # The prompt's token ids as the engine tokenizes them, for kv_aware; None when not known.
    token_ids: tuple[int, ...] | None = None
    # kv_aware writes the prompt blocks it predicts each scored engine has cached (address → blocks).
    predicted_blocks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SelectionOptions:
    """Tunables of the strategies (from GatewayConfig); `seed` makes random choices repeatable in tests."""

    affinity_load_factor: float = 2.0
    seed: int | None = None
    kv_index: KvIndex | None = None  # kv_aware: the pool's index of the engines' cached blocks
    kv_overlap_weight: float = 8.0
    router_temperature: float = 0.0


Node = TypeVar("Node", bound=RoutableNode)


class EngineSelector(ABC):
    """Picks the engine for one request among ready candidates (never empty, in the pool's order).

    A subclass that sets `name` is registered under it and becomes a `--routing` value.
    """

    name: ClassVar[str | None] = None

    def __init__(self, options: SelectionOptions | None = None) -> None:
        self.options = options or SelectionOptions()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name is not None:
            if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
                raise TypeError(f"routing strategy {cls.name!r} is defined twice")
            _REGISTRY[cls.name] = cls

    @abstractmethod
    def choose(self, candidates: Sequence[Node], request: RouteRequest | None = None) -> Node:
        """The node to send `request` to."""


def within_load_bound(candidates: Sequence[Node], factor: float) -> list[Node]:
    """The candidates that may take one more request (consistent hashing with bounded loads): those whose
    in-flight count stays within `factor` × the mean, counting the request being placed, so an idle pool
    admits it anywhere. From this gateway's own in-flight counts, which are exact and immediate; the
    engines' polled load lags and would make an idle engine look busy right after a request."""
    bound = math.ceil(factor * (sum(node.in_flight for node in candidates) + 1) / len(candidates))
    return [node for node in candidates if node.in_flight + 1 <= bound]


def registered_strategies() -> dict[str, type[EngineSelector]]:
    return dict(_REGISTRY)


def unregister_strategy(name: str) -> None:
    """Forget the strategy registered as `name` (one defined only for a while, such as in a test)."""
    _REGISTRY.pop(name, None)
