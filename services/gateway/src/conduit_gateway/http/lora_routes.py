"""Loading and unloading LoRA adapters at run time, in vLLM's shapes: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter reach every engine of the base model. Mounted only with admin keys, which guard
these two paths instead of the API keys (http/app.py); with --admin-port they answer on that port only."""

from __future__ import annotations

import asyncio

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from conduit_gateway.errors import OpenAIError, from_rpc_error, invalid_param, no_engine_ready
from conduit_gateway.http.admin_port import ADMIN_PATHS
from conduit_gateway.routing.lora import LORA_LOAD_TIMEOUT_S
from conduit_gateway.routing.node import EngineNode
from conduit_gateway.routing.pool import EnginePool
from conduit_gateway.schemas.common import error_responses
from conduit_gateway.schemas.models import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

LOAD_PATH, UNLOAD_PATH = ADMIN_PATHS
PATHS = ADMIN_PATHS

router = APIRouter(tags=["lora"])


def _pool(request: Request) -> EnginePool:
    return request.app.state.ctx.pool


def _base_engines(pool: EnginePool, base_model: str | None) -> list[EngineNode]:
    """The serving engines of the adapter's base model: `base_model`, or the one model served."""
    serving = [node for node in pool.engines if node.serving and node.model is not None]
    if not serving:
        raise no_engine_ready()
    models = sorted({node.model for node in serving if node.model is not None})
    if base_model is None:
        if len(models) > 1:
            raise invalid_param(
                "base_model", f"required when several models are served ({', '.join(models)})"
            )
        base_model = models[0]
    engines = [node for node in serving if node.model == base_model]
    if not engines:
        raise invalid_param("base_model", f"no engine serves {base_model!r} (served: {', '.join(models)})")
    return engines


@router.post(LOAD_PATH, response_class=PlainTextResponse, responses=error_responses(400, 401, 503))
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """Load the adapter on every engine of its base model; an engine that has it already keeps it."""
    if not body.lora_name:
        raise invalid_param("lora_name", "must not be empty")
    if not body.lora_path:
        raise invalid_param("lora_path", "must not be empty")
    pool = _pool(request)
    engines = _base_engines(pool, body.base_model)
    if body.lora_name in {node.model for node in pool.engines}:
        raise invalid_param("lora_name", f"{body.lora_name!r} is the name of a base model")
    loader = pool.lora_loader
    results = await asyncio.gather(
        *(loader.ensure(node, body.lora_name, body.lora_path) for node in engines), return_exceptions=True
    )
    _raise_first_failure(engines, results, pool)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(UNLOAD_PATH, response_class=PlainTextResponse, responses=error_responses(400, 401, 404, 503))
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """Unload the adapter from every engine that has it."""
    pool = _pool(request)
    engines = [node for node in pool.engines if node.serving and body.lora_name in node.lora_adapters]
    if not engines:
        raise OpenAIError(
            404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name", code="not_found"
        )
    results = await asyncio.gather(
        *(node.client.unload_lora(body.lora_name, LORA_LOAD_TIMEOUT_S) for node in engines),
        return_exceptions=True,
    )
    for node, result in zip(engines, results, strict=True):
        missing = isinstance(result, grpc.aio.AioRpcError) and result.code() is grpc.StatusCode.NOT_FOUND
        if result is None or missing:
            node.lora_adapters.pop(body.lora_name, None)
    _raise_first_failure(engines, results, pool, ignore=grpc.StatusCode.NOT_FOUND)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _raise_first_failure(
    engines: list[EngineNode],
    results: list[object],
    pool: EnginePool,
    ignore: grpc.StatusCode | None = None,
) -> None:
    """The first engine's refusal as the client's error, naming the engine and those that succeeded."""
    done = [
        node.address for node, r in zip(engines, results, strict=True) if not isinstance(r, BaseException)
    ]
    for node, result in zip(engines, results, strict=True):
        if isinstance(result, grpc.aio.AioRpcError):
            if result.code() is ignore:
                continue
            error = from_rpc_error(result, pool.config.retry_after_s)
            done_note = f"; done on {', '.join(done)}" if done else ""
            error.message = f"{error.message} (engine {node.address}{done_note})"
            raise error
        if isinstance(result, BaseException):
            raise result
