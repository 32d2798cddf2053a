"""Builds the gateway's ASGI app: routes, OpenAI-shaped error handlers, middleware and engine lifespan."""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from opentelemetry.sdk.trace import TracerProvider
from starlette.exceptions import HTTPException as StarletteHTTPException

from conduit_common.tracing import otlp_tracer_provider
from conduit_gateway import __version__
from conduit_gateway.config import GatewayConfig
from conduit_gateway.context import GatewayContext
from conduit_gateway.errors import OpenAIError
from conduit_gateway.handlers.drain import cancel_drains
from conduit_gateway.http import admin, lora_routes
from conduit_gateway.http.admin_port import AdminPortMiddleware
from conduit_gateway.http.anthropic import AnthropicApiMiddleware
from conduit_gateway.http.direct_routes import DirectRoutes
from conduit_gateway.http.middleware import (
    GENERATION_PATHS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    InternalErrorMiddleware,
    KeyLimitsMiddleware,
    MetricsMiddleware,
    RequestIdMiddleware,
)
from conduit_gateway.http.responses_routes import router as responses_router
from conduit_gateway.http.routes import router
from conduit_gateway.http.tokenize_routes import router as tokenize_router
from conduit_gateway.http.tracing import TracingMiddleware
from conduit_gateway.http.validation import validation_error
from conduit_gateway.keys.rate_limit import Clock
from conduit_gateway.prompt_limits import body_limit
from conduit_gateway.responses.service import ResponsesService, store_from_config
from conduit_gateway.routing.discovery import Resolver
from conduit_gateway.workers.slot import WorkerSlot


def create_app(
    config: GatewayConfig,
    resolver: Resolver | None = None,
    clock: Clock = time.monotonic,
    tracer_provider: TracerProvider | None = None,
    worker: WorkerSlot | None = None,
) -> FastAPI:
    """The gateway app for `config`; engine channels open when the app starts (its lifespan).

    `resolver` replaces the DNS lookups of --engine-dns, `clock` the rate limits' time, `tracer_provider`
    the one --otlp-endpoint would make (tests inject them; they read spans in memory). Reads the keys
    file and the engines' TLS and token files now (KeysFileError, SecretFileError). `worker`: this app is
    one worker of --workers N (workers/supervisor.py), sharing key limits, admin changes and /metrics.
    """
    ctx = GatewayContext.create(config, resolver, clock, worker)
    responses = ResponsesService(store_from_config(config))
    owned_provider = None
    if tracer_provider is None and config.otlp_endpoint is not None:
        tracer_provider = owned_provider = otlp_tracer_provider("conduit-gateway", config.otlp_endpoint)
    tracer = tracer_provider.get_tracer("conduit_gateway") if tracer_provider is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if threading.current_thread() is threading.main_thread():
            # Signals reach the main thread only (an app served from a test's thread has no SIGHUP).
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, ctx.reload)
        await ctx.pool.start()
        if ctx.admin_log is not None:
            ctx.admin_log.start()  # after the static nodes: the siblings' removals apply to them too
        if ctx.metrics_peers is not None:
            await ctx.metrics_peers.start()
        await responses.start()
        if ctx.worker is not None:
            ctx.worker.mark_ready()
        # What is alive now (the app, FastAPI's and pydantic's schemas, grpc, protobuf, OpenTelemetry)
        # lives as long as the process: keep the garbage collector from walking it again in every full
        # collection while serving.
        gc.freeze()
        try:
            yield
        finally:
            await responses.stop()
            if ctx.metrics_peers is not None:
                await ctx.metrics_peers.stop()
            if ctx.admin_log is not None:
                await ctx.admin_log.stop()
            await cancel_drains(ctx.drains)
            await ctx.pool.stop()
            if owned_provider is not None:
                owned_provider.shutdown()  # flushes the spans not yet exported

    app = FastAPI(
        title="Conduit gateway",
        version=__version__,
        description="OpenAI chat and completions, and Anthropic's Messages API, over Conduit engines.",
        lifespan=lifespan,
        redoc_url=None,
    )
    app.state.ctx = ctx
    app.state.responses = responses
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(tokenize_router)
    if config.admin_keys:
        # Off unless configured: without admin keys /admin does not exist (404).
        app.include_router(admin.router)
        app.include_router(lora_routes.router)  # LoRA load/unload: the admin keys guard them
    _add_error_handlers(app)
    # add_middleware wraps: the last one added runs first. Innermost: the generation endpoints' requests
    # answered without FastAPI's routing (http/direct_routes.py).
    generation = [
        route
        for route in (*router.routes, *responses_router.routes)
        if isinstance(route, APIRoute) and route.path in GENERATION_PATHS and "POST" in route.methods
    ]
    app.add_middleware(DirectRoutes, routes=generation, handlers=app.exception_handlers)
    # --max-body-bytes, or less on the prompt routes once the engines' prompt bounds are known.
    app.add_middleware(
        BodyLimitMiddleware,
        limit=lambda path: body_limit(path, config.max_body_bytes, ctx.pool),
        timeout_s=config.body_timeout_s,
    )
    app.add_middleware(KeyLimitsMiddleware, limiter=ctx.rate_limiter)  # inside ApiKeyMiddleware: the key
    app.add_middleware(ApiKeyMiddleware, keys=ctx.api_keys, exempt=lora_routes.PATHS)
    app.add_middleware(ApiKeyMiddleware, keys=ctx.admin_keys, prefix=("/admin", *lora_routes.PATHS))
    if config.admin_port is not None:
        app.add_middleware(AdminPortMiddleware, admin_port=config.admin_port)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(AnthropicApiMiddleware)  # /v1/messages: every error above in Anthropic's shape
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    app.add_middleware(TracingMiddleware, tracer=tracer)
    app.add_middleware(RequestIdMiddleware, worker=worker.index if worker is not None else None)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        error = OpenAIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with its default 422 responses removed: validation errors are OpenAI 400s here."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema
