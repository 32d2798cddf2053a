"""The admin API: list, add, drain, resume and remove engine nodes at run time.

Mounted only when admin keys are configured; ApiKeyMiddleware(prefix="/admin") checks the key first.
Under --workers, each change goes through the shared admin log (workers/admin_log.py), so it reaches
every worker's pool; a node's counters (in_flight, routed, ...) are the answering worker's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from conduit_gateway.config import ConfigError
from conduit_gateway.errors import OpenAIError, invalid_param
from conduit_gateway.routing.admin_nodes import NodeAddressError, parse_allow_list, parse_node_address
from conduit_gateway.routing.node import EngineNode, NodeSource
from conduit_gateway.routing.pool import DuplicateNodeError, EnginePool, UnknownNodeError
from conduit_gateway.routing.roles import NodeRole
from conduit_gateway.schemas.admin import AddNodeRequest, NodeList, NodeView
from conduit_gateway.schemas.common import error_responses
from conduit_gateway.workers.admin_log import Record

router = APIRouter(prefix="/admin", tags=["admin"])

_NODE_ERRORS = error_responses(401, 404)


def _pool(request: Request) -> EnginePool:
    ctx = request.app.state.ctx
    if ctx.admin_log is not None:
        ctx.admin_log.catch_up()  # the other workers' changes, before answering
    return ctx.pool


@contextlib.contextmanager
def _change(request: Request) -> Iterator[Record]:
    """A change to the pool: under --workers, made holding the shared admin log (caught up first) and
    recorded in it. Inside, read the pool as `ctx.pool`: `_pool` would take the log's lock again."""
    admin_log = request.app.state.ctx.admin_log
    if admin_log is None:
        yield lambda *args, **kwargs: None
        return
    with admin_log.change() as record:
        yield record


def node_view(node: EngineNode, removed: bool = False) -> NodeView:
    latency = node.token_latency_s
    return NodeView(
        address=node.address,
        source=node.source.value,
        role=node.role.value,
        state="removed" if removed else node.state,
        refusal=node.refusal,
        serving=node.serving,
        model=node.model,
        in_flight=node.in_flight,
        routed=node.routed,
        failures=node.failures,
        ejections=node.ejections,
        load_score=node.load_score,
        token_latency_ms=round(latency * 1000, 3) if latency is not None else None,
        load=node.load,
        kv_indexed_blocks=node.indexed_blocks,
    )


def _node(pool: EnginePool, address: str) -> EngineNode:
    try:
        return pool.node(address)
    except UnknownNodeError:
        raise _unknown(address) from None


def _unknown(address: str) -> OpenAIError:
    return OpenAIError(
        404, f"No engine node has the address {address!r}.", param="address", code="node_not_found"
    )


@router.get("/nodes", response_model=NodeList, responses=error_responses(401))
async def list_nodes(request: Request) -> NodeList:
    return NodeList(nodes=[node_view(node) for node in _pool(request).engines])


@router.post(
    "/nodes", status_code=201, response_model=NodeView, responses=error_responses(400, 401, 403, 409)
)
async def add_node(body: AddNodeRequest, request: Request) -> JSONResponse:
    """Add an engine; it receives requests once its health says SERVING.

    The address is HOST:PORT only (a DNS name, IPv4 or [IPv6] host; no gRPC schemes, 400), inside
    --admin-node-allow when that is set (403 `node_not_allowed`), and the API holds at most
    --admin-max-nodes nodes (409 `too_many_nodes`). Over plain gRPC the node is dialled without the
    engine token; only over verified TLS (--engine-tls-ca) does it receive it.

    A prefill or decode engine that answers now is checked at once: one whose engine role does not cover
    the pool, or whose KV layout differs from the other disaggregated engines' of its model, is not added
    (409 `node_refused`). One that does not answer yet is checked when it starts serving.
    """
    pool = request.app.state.ctx.pool
    with _change(request) as record:
        _check_admin_address(pool, body.address)
        role = NodeRole(body.role)
        if role is NodeRole.PREFILL and pool.dialer.token is not None and not pool.dialer.secure:
            # Decode engines pull a prefill's KV from the address it hands them, with their own token.
            raise OpenAIError(
                409,
                f"The prefill engine {body.address} was not added: over plain gRPC, decode engines would "
                "send their engine token to it; add it with engine TLS (--engine-tls-ca) or as "
                "--prefill-engine.",
                param="role",
                code="node_refused",
            )
        try:
            node = pool.add(body.address, NodeSource.ADMIN, role)
        except ConfigError as exc:
            raise invalid_param("address", str(exc).removeprefix("address: ")) from None
        except DuplicateNodeError:
            raise OpenAIError(
                409,
                f"The engine {body.address.strip()!r} is already in the pool.",
                param="address",
                code="node_exists",
            ) from None
        record("add", node.address, node.role.value)
    if node.role.disaggregated:
        await node.check(pool.config.health_check_timeout_s)
        if node.refusal is not None:
            with _change(request) as record:
                if node.address in {n.address for n in pool.engines}:
                    pool.remove(node.address)
                    record("remove", node.address)
            raise OpenAIError(
                409,
                f"The {node.role} engine {node.address} was not added: {node.refusal}.",
                param="address",
                code="node_refused",
            )
    return JSONResponse(node_view(node).model_dump(), status_code=201)


def _check_admin_address(pool: EnginePool, address: str) -> None:
    """400 unless HOST:PORT, 403 outside the allow list, 409 when the admin nodes are at their bound;
    all before anything dials the address."""
    try:
        parsed = parse_node_address(address)
    except NodeAddressError as exc:
        shown = address if len(address) <= 80 else f"{address[:80]}..."
        raise invalid_param("address", f"expected HOST:PORT: {exc}, got {shown!r}") from None
    config = pool.config
    if not parse_allow_list(tuple(config.admin_node_allow)).allows(parsed):
        raise OpenAIError(
            403,
            f"address: {address} is outside --admin-node-allow.",
            param="address",
            code="node_not_allowed",
        )
    if address not in {node.address for node in pool.engines}:
        if pool.count(NodeSource.ADMIN) >= config.admin_max_nodes:
            raise OpenAIError(
                409,
                f"address: the admin API already holds {config.admin_max_nodes} node(s) "
                "(--admin-max-nodes); remove one first.",
                param="address",
                code="too_many_nodes",
            )


@router.get("/nodes/{address}", response_model=NodeView, responses=_NODE_ERRORS)
async def get_node(address: str, request: Request) -> NodeView:
    return node_view(_node(_pool(request), address))


@router.delete("/nodes/{address}", response_model=NodeView, responses=_NODE_ERRORS)
async def remove_node(address: str, request: Request) -> NodeView:
    """Remove an engine: no new requests at once; its open requests finish, then its channel closes.

    A node found by DNS discovery comes back at the next resolution that still lists it.
    """
    with _change(request) as record:
        try:
            node = request.app.state.ctx.pool.remove(address)
        except UnknownNodeError:
            raise _unknown(address) from None
        record("remove", address)
    return node_view(node, removed=True)


@router.post("/nodes/{address}/drain", response_model=NodeView, responses=_NODE_ERRORS)
async def drain_node(address: str, request: Request) -> NodeView:
    """Stop sending new requests to an engine; open ones finish (watch `in_flight` reach 0)."""
    with _change(request) as record:
        pool = request.app.state.ctx.pool
        _node(pool, address)
        record("drain", address)
        return node_view(pool.drain(address))


@router.post("/nodes/{address}/resume", response_model=NodeView, responses=_NODE_ERRORS)
async def resume_node(address: str, request: Request) -> NodeView:
    """Undo a drain: the engine receives requests again while its health says SERVING."""
    with _change(request) as record:
        pool = request.app.state.ctx.pool
        _node(pool, address)
        record("resume", address)
        return node_view(pool.resume(address))
