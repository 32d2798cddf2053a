"""The generation endpoints, served without FastAPI's per-request routing.

Each request FastAPI routes walks the included routers' versions and patterns, opens two exit stacks and
solves the endpoint's dependencies before the endpoint runs: a tenth of what a short stream costs the
gateway. The POST routes named here are still declared on their FastAPI router (the OpenAPI schema, the
405 of another method, a path under a root path go through FastAPI as before), but `DirectRoutes`, the
innermost middleware, answers their requests itself with FastAPI's own pieces, so that nothing a client
sees changes: the body read and parsed as the route's Request reads it (http/request_body.py), the
route's raw-body check, the body's JSON only under a JSON Content-Type and FastAPI's `json_invalid`
error otherwise, the body validated by `request_body_to_args` against the route's own body field, and
errors answered by the app's own exception handlers (http/app.py).
"""

from __future__ import annotations

import email.message
import functools
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi._compat import Undefined
from fastapi.dependencies.utils import request_body_to_args
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.request_body import GatewayRequest, body_check

ExceptionHandler = Callable[[Request, Any], Awaitable[Response]]
# What the app's exception handlers answer (http/app.py), as FastAPI's ExceptionMiddleware would.
_HANDLED = (OpenAIError, RequestValidationError, HTTPException)


class DirectRoutes:
    """Answers POST requests to `routes` without FastAPI's router; every other request goes on to `app`.
    Each route's endpoint takes its JSON body (one body parameter) and `request`, and returns a Response.
    `handlers`: the app's exception handlers, by exception class (FastAPI's `app.exception_handlers`)."""

    def __init__(
        self, app: ASGIApp, routes: Iterable[APIRoute], handlers: dict[Any, ExceptionHandler]
    ) -> None:
        self.app = app
        self._routes: dict[str, APIRoute] = {}
        for route in routes:
            dependant = route.dependant
            if len(dependant.body_params) != 1 or dependant.request_param_name != "request":
                raise ValueError(f"{route.path}: a direct route takes one body parameter and `request`")
            self._routes[route.path] = route
        self._handlers = [(kind, handlers[kind]) for kind in _HANDLED]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self._routes.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route  # as FastAPI's match sets it (the metrics' route label)
        request = GatewayRequest(scope, receive, send)
        try:
            response = await _respond(route, request)
        except _HANDLED as exc:
            handler = next(handler for kind, handler in self._handlers if isinstance(exc, kind))
            response = await handler(request, exc)
        await response(scope, receive, send)


async def _respond(route: APIRoute, request: GatewayRequest) -> Response:
    """The route's response, as FastAPI's request handler and GatewayRoute make it."""
    body_bytes = await request.body()
    check = body_check(route.path)
    if check is not None:
        check(request, body_bytes)
    fields = route.dependant.body_params
    values, errors = await request_body_to_args(fields, await _body(request, body_bytes), False)
    if errors:
        raise RequestValidationError(errors)
    response = await route.endpoint(**values, request=request)
    assert isinstance(response, Response)
    return response


async def _body(request: GatewayRequest, body_bytes: bytes) -> Any:
    """What FastAPI's request handler makes of a body for a JSON body parameter: nothing when empty, the
    bytes under another Content-Type (or none), else the parsed JSON."""
    if not body_bytes:
        return Undefined
    content_type = request.headers.get("content-type")
    if not content_type or not _is_json(content_type):
        return body_bytes
    try:
        return await request.json()
    except json.JSONDecodeError as exc:
        error = {
            "type": "json_invalid",
            "loc": ("body", exc.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": exc.msg},
        }
        raise RequestValidationError([error], body=exc.doc) from exc
    except Exception as exc:
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc


@functools.lru_cache(maxsize=64)
def _is_json(content_type: str) -> bool:
    """application/json or application/*+json, as FastAPI reads a Content-Type."""
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")
