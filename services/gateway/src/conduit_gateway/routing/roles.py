"""Which pool a node serves (whole requests, or one side of disaggregated ones), and whether its engine may
join it: the engine's own role must cover the pool, and every prefill and decode engine of one model must
share one KV layout (equal fingerprints), or they could not exchange KV blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Protocol

from conduit.engine.v1 import engine_pb2

_ENGINE_ROLE_NAMES = {
    engine_pb2.ENGINE_ROLE_UNSPECIFIED: "unspecified (an engine without disaggregation)",
    engine_pb2.ENGINE_ROLE_BOTH: "both",
    engine_pb2.ENGINE_ROLE_PREFILL: "prefill",
    engine_pb2.ENGINE_ROLE_DECODE: "decode",
}


class NodeRole(enum.StrEnum):
    """The pool a node belongs to: --engine (whole requests), --prefill-engine or --decode-engine."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def disaggregated(self) -> bool:
        return self is not NodeRole.COLOCATED


# The engine roles (GetModelInfo.role) that can serve each side: a `both` engine serves either.
_SERVES = {
    NodeRole.PREFILL: {engine_pb2.ENGINE_ROLE_PREFILL, engine_pb2.ENGINE_ROLE_BOTH},
    NodeRole.DECODE: {engine_pb2.ENGINE_ROLE_DECODE, engine_pb2.ENGINE_ROLE_BOTH},
}


class PeerNode(Protocol):
    """What the layout check reads of the other nodes (EngineNode implements it)."""

    @property
    def address(self) -> str: ...

    @property
    def role(self) -> NodeRole: ...

    @property
    def model_info(self) -> engine_pb2.GetModelInfoResponse | None: ...


def describe_layout(layout: engine_pb2.KvLayout) -> str:
    return (
        f"fingerprint {layout.fingerprint[:12] or '(none)'}: model {layout.model}, {layout.dtype}, "
        f"block size {layout.block_size}, {layout.num_layers} layers, {layout.num_kv_heads} KV heads, "
        f"head dim {layout.head_dim}"
    )


def admission_problem(
    role: NodeRole, info: engine_pb2.GetModelInfoResponse, peers: Iterable[PeerNode]
) -> str | None:
    """Why an engine answering `info` may not serve as a `role` node, or None. `peers` are the admitted
    prefill and decode nodes (SERVING in the pool) of the other disaggregated nodes."""
    if not role.disaggregated:
        return None
    if info.role not in _SERVES[role]:
        return (
            f"its engine's role is {_ENGINE_ROLE_NAMES.get(info.role, info.role)}; a {role} node needs an "
            f"engine started with --role {role} or --role both"
        )
    if not info.kv_layout.fingerprint:
        return "its engine reports no KV layout"
    for peer in peers:
        other = peer.model_info
        if other is None or other.model != info.model or not peer.role.disaggregated:
            continue
        if other.kv_layout.fingerprint != info.kv_layout.fingerprint:
            return (
                f"its KV layout ({describe_layout(info.kv_layout)}) differs from {peer.role} engine "
                f"{peer.address}'s ({describe_layout(other.kv_layout)}): engines whose KV layouts differ "
                "cannot exchange KV blocks"
            )
    return None
