"""POST /tokenize and /detokenize: the engine's tokenizer, through an engine serving the model.

Outside /v1 (vLLM's paths), so the API-key check that middleware does for /v1 is done here.
"""

from __future__ import annotations

import json

import grpc
from fastapi import APIRouter, Request

from conduit.engine.v1 import engine_pb2
from conduit_gateway.context import GatewayContext
from conduit_gateway.errors import OpenAIError, from_rpc_error, invalid_param
from conduit_gateway.handlers import fields
from conduit_gateway.handlers.chat import _message
from conduit_gateway.http.request_body import GatewayRoute
from conduit_gateway.http.routes import _ctx
from conduit_gateway.prompt_limits import prompt_limit
from conduit_gateway.routing.node import EngineNode
from conduit_gateway.routing.pool import require_serving
from conduit_gateway.routing.selection.base import RouteRequest
from conduit_gateway.schemas.common import error_responses
from conduit_gateway.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(route_class=GatewayRoute)
_ERRORS = error_responses(400, 401, 404, 503)
_ALIASES = {"text": "prompt", "chat": "messages", "input": "prompt", "chat.tools_json": "tools"}


def _check_key(request: Request, ctx: GatewayContext) -> None:
    if not ctx.api_keys.enabled:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or ctx.api_keys.lookup(token.strip()) is None:
        raise OpenAIError(
            401,
            "Incorrect or missing API key.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def _node(request: Request, model: str | None) -> tuple[GatewayContext, EngineNode]:
    ctx = _ctx(request)
    _check_key(request, ctx)
    require_serving(ctx.pool)
    if model is None:
        served = sorted(ctx.pool.served_models())
        if len(served) != 1:
            raise invalid_param("model", f"is required: this gateway serves {len(served)} models")
        model = served[0]
    return ctx, await ctx.pool.acquire(RouteRequest(model=model))


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise invalid_param("prompt", "give exactly one of prompt or messages")
    ctx, node = await _node(request, body.model)
    limit = prompt_limit(ctx.pool, node.model) if node.model is not None else None
    call = engine_pb2.TokenizeRequest()
    if body.prompt is not None:
        call.text = fields.text("prompt", body.prompt)
        if limit is not None:
            limit.check_texts("prompt", (call.text,))
        if body.add_special_tokens is not None:
            call.add_special_tokens = body.add_special_tokens
    else:
        messages = body.messages or []
        call.chat.messages.extend(_message(index, message) for index, message in enumerate(messages))
        if body.add_generation_prompt is not None:
            call.chat.add_generation_prompt = body.add_generation_prompt
        if body.tools:
            call.chat.tools_json = json.dumps([tool.model_dump(exclude_none=True) for tool in body.tools])
        if limit is not None:
            limit.check_chat("messages", call.chat)
    try:
        reply = await node.client.tokenize(call, ctx.config.model_info_timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, ctx.config.retry_after_s, _ALIASES) from None
    info = node.model_info
    return TokenizeResponse(
        count=len(reply.token_ids),
        max_model_len=info.max_model_len if info is not None else 0,
        tokens=list(reply.token_ids),
        token_strs=list(reply.tokens) if body.return_token_strs else None,
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx, node = await _node(request, body.model)
    call = engine_pb2.DetokenizeRequest(token_ids=fields.token_ids("tokens", body.tokens))
    if body.skip_special_tokens is not None:
        call.skip_special_tokens = body.skip_special_tokens
    try:
        reply = await node.client.detokenize(call, ctx.config.model_info_timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, ctx.config.retry_after_s, {"token_ids": "tokens"}) from None
    return DetokenizeResponse(prompt=reply.text)
