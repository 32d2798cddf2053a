"""Shapes of the admin API (/admin/nodes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from conduit_gateway.routing.load import LoadReport
from conduit_gateway.schemas.common import StrictModel

Role = Literal["colocated", "prefill", "decode"]


class AddNodeRequest(StrictModel):
    address: str = Field(description="The engine's gRPC address, HOST:PORT.")
    role: Role = Field(
        "colocated",
        description="The pool it joins: colocated (whole requests, like --engine), or the prefill or decode "
        "side of disaggregated requests (like --prefill-engine / --decode-engine).",
    )


class NodeView(BaseModel):
    address: str
    source: Literal["static", "dns", "admin"] = Field(description="--engine, DNS discovery or this API.")
    role: Role = Field(description="The pool it serves: colocated, prefill or decode.")
    state: Literal["serving", "unavailable", "refused", "draining", "removed"] = Field(
        description="serving: receives requests; unavailable: its health is not SERVING; refused: its engine "
        "serves but may not join its pool (see `refusal`); draining: drained (or removed) by an operator, "
        "open requests finish; removed: no longer in the pool."
    )
    refusal: str | None = Field(
        None, description="Why the engine may not join its pool (wrong engine role, another KV layout)."
    )
    serving: bool = Field(description="Its engine's health says SERVING.")
    model: str | None
    in_flight: int = Field(description="This gateway's requests open on the node.")
    routed: int = Field(description="Requests sent to the node (retries included).")
    failures: int = Field(description="Requests the node failed with an engine-side error.")
    ejections: int = Field(description="Times the node left the rotation by health or an unreachable engine.")
    load_score: int = Field(description="Requests at the node, as least_load sees them.")
    token_latency_ms: float | None = Field(description="Recent milliseconds per generated token.")
    load: LoadReport | None = Field(description="The engine's last GetLoad answer (null when unknown).")
    kv_indexed_blocks: int | None = Field(
        None,
        description="kv_aware: the engine's cached blocks in the gateway's KV index (null without kv_aware, "
        "or while its event snapshot has not arrived).",
    )


class NodeList(BaseModel):
    nodes: list[NodeView]
