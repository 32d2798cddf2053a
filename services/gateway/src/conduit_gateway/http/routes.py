"""The HTTP endpoints: generation, models, health and metrics."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from conduit_gateway.context import GatewayContext
from conduit_gateway.errors import model_not_found
from conduit_gateway.handlers.chat import ChatHandler
from conduit_gateway.handlers.completions import CompletionsHandler
from conduit_gateway.handlers.messages import MessagesHandler, count_tokens
from conduit_gateway.http import anthropic
from conduit_gateway.http.request_body import GatewayRoute, check_body_before_parsing
from conduit_gateway.http.sse import unless_disconnected
from conduit_gateway.keys.keys_file import ApiKey
from conduit_gateway.prompt_limits import refuse_unfit_completion
from conduit_gateway.routing.lora import AdapterView, adapters
from conduit_gateway.routing.node import EngineNode
from conduit_gateway.routing.pool import require_serving
from conduit_gateway.schemas.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from conduit_gateway.schemas.common import error_responses
from conduit_gateway.schemas.completions import Completion, CompletionRequest
from conduit_gateway.schemas.messages import (
    AnthropicError,
    Message,
    MessageInputs,
    MessagesRequest,
    MessageTokensCount,
)
from conduit_gateway.schemas.models import ModelCard, ModelList

router = APIRouter(route_class=GatewayRoute)

_GENERATION_ERRORS = error_responses(400, 401, 404, 413, 429, 503)
_SSE = {
    "text/event-stream": {"schema": {"type": "string", "description": "data: {json} events, then [DONE]"}}
}


def _ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


def _api_key(request: Request) -> ApiKey | None:
    """The key ApiKeyMiddleware matched (None when no keys are configured)."""
    return getattr(request.state, "api_key", None)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={200: {"content": _SSE, "description": f"With stream: {ChatCompletionChunk.__name__} events."}}
    | _GENERATION_ERRORS,
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    handler = ChatHandler(_ctx(request), body, request.state.request_id, _api_key(request))
    return await _until_disconnect(request, handler.handle())


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={200: {"content": _SSE, "description": "With stream: completion chunk events."}}
    | _GENERATION_ERRORS,
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    handler = CompletionsHandler(_ctx(request), body, request.state.request_id, _api_key(request))
    return await _until_disconnect(request, handler.handle())


# An 8 MB prompt string is refused before FastAPI parses and validates it (prompt_limits.py).
check_body_before_parsing(
    "/v1/completions", lambda request, body: refuse_unfit_completion(_ctx(request).pool, body)
)


# Anthropic's Messages API; http/anthropic.py gives its errors Anthropic's shape (529 for 503).
_MESSAGES_ERRORS = {status: {"model": AnthropicError} for status in (400, 401, 404, 413, 429, 529)}
_MESSAGE_EVENTS = {
    "text/event-stream": {"schema": {"type": "string", "description": "event: NAME / data: {json} events"}}
}


@router.post(
    "/v1/messages",
    response_model=Message,
    responses={200: {"content": _MESSAGE_EVENTS, "description": "With stream: Anthropic's events."}}
    | _MESSAGES_ERRORS,
)
async def messages(body: MessagesRequest, request: Request) -> Response:
    handler = MessagesHandler(_ctx(request), body, request.state.request_id, _api_key(request))
    return await _until_disconnect(request, handler.handle())


@router.post("/v1/messages/count_tokens", response_model=MessageTokensCount, responses=_MESSAGES_ERRORS)
async def messages_count_tokens(body: MessageInputs, request: Request) -> MessageTokensCount:
    return await count_tokens(_ctx(request), body)


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 503))
async def list_models(request: Request) -> ModelList | JSONResponse:
    pool = _ctx(request).pool
    require_serving(pool)
    served = sorted(pool.served_models().items())
    if anthropic.VERSION_HEADER in request.headers:  # an anthropic SDK: its page of ModelInfo
        return JSONResponse(anthropic.model_page([_anthropic_info(name, engine) for name, engine in served]))
    loras = sorted(adapters(pool.routable()).values(), key=lambda view: view.name)
    return ModelList(data=[_card(name, engine) for name, engine in served] + [_lora_card(v) for v in loras])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404, 503))
async def retrieve_model(model_id: str, request: Request) -> ModelCard | JSONResponse:
    pool = _ctx(request).pool
    require_serving(pool)
    engine = pool.served_models().get(model_id)
    if engine is None:
        view = adapters(pool.routable()).get(model_id)
        if view is not None and anthropic.VERSION_HEADER not in request.headers:
            return _lora_card(view)
        raise model_not_found(model_id)
    if anthropic.VERSION_HEADER in request.headers:
        return JSONResponse(_anthropic_info(model_id, engine))
    return _card(model_id, engine)


@router.get("/health", responses={503: {"description": "No engine is SERVING (and not drained)."}})
async def health(request: Request) -> JSONResponse:
    pool = _ctx(request).pool
    # Checked now rather than from the poller's last round, so a probe sees the engines' current state.
    ready = await pool.refresh()
    engines = [{"address": e.address, "serving": e.serving, "model": e.model} for e in pool.engines]
    return JSONResponse(
        {"status": "ok" if ready else "unavailable", "engines": engines}, status_code=200 if ready else 503
    )


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    ctx = _ctx(request)
    if ctx.metrics_peers is not None:  # --workers: the sum over every worker
        return Response(await ctx.metrics_peers.render(), media_type=CONTENT_TYPE_LATEST)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _anthropic_info(name: str, engine: EngineNode) -> dict[str, Any]:
    info = engine.model_info
    return anthropic.model_info(name, engine.model_seen_at, info.max_model_len if info is not None else None)


def _card(name: str, engine: EngineNode) -> ModelCard:
    info = engine.model_info
    return ModelCard(
        id=name, created=engine.model_seen_at, max_model_len=info.max_model_len if info is not None else None
    )


def _lora_card(view: AdapterView) -> ModelCard:
    card = _card(view.name, view.nodes[0])
    return card.model_copy(update={"root": view.path or None, "parent": view.parent})


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it (and so its engine streams) if the client disconnects first.

    Streamed responses watch for disconnects themselves once they start; this covers the wait for the
    first token and a whole non-streamed generation.
    """
    response, gone = await unless_disconnected(request.scope, request.receive, work)
    if gone or response is None:
        # Nobody is listening; the status only reaches the access log and metrics.
        return Response(status_code=499)
    return response
