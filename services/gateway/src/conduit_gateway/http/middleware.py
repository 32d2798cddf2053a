"""Pure-ASGI middleware, outermost first: request ids, metrics, the last-resort 500, API keys, body limit.

Pure ASGI (not BaseHTTPMiddleware) so that streamed responses pass through untouched and a client
disconnect still reaches the SSE response's receive().
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conduit_common.logs import current_client_request_id, current_request_id
from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.metrics import GatewayMetrics
from conduit_gateway.http.request_body import BODY_SCOPE_KEY
from conduit_gateway.keys.rate_limit import RateLimited, RateLimiter
from conduit_gateway.keys.store import ApiKeyStore

log = logging.getLogger(__name__)

# Client ids are echoed into headers and logs: keep them short and printable.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


async def send_error(send: Send, error: OpenAIError) -> None:
    body = error.body_json().encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(key.lower().encode(), value.encode()) for key, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ResponseStatus:
    """Wraps `send` to see the response start: `code` stays 499 until then (the client left first)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.code = 499

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.code = message["status"]
        await self._send(message)


class HttpMiddleware:
    """Middleware for HTTP requests: `handle` sees every HTTP request; other scopes (the lifespan) pass
    through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestIdMiddleware(HttpMiddleware):
    """Give every request the gateway's own id (`request.state.request_id`: unique, the engine's request
    id, the base of response ids) and keep the client's X-Request-Id apart (`client_request_id`): a
    client's id names nothing in the engine, so no tenant can collide with another's running request.

    Responses carry X-Request-Id: the client's own id echoed, or the gateway's when it sent none (or one
    that is not short and printable). Every log line of the request (uvicorn's access line included)
    carries `request_id`, and `client_request_id` when the client gave one. Under --workers, responses
    also say which worker served them (X-Conduit-Worker)."""

    def __init__(self, app: ASGIApp, worker: int | None = None) -> None:
        super().__init__(app)
        self._worker = str(worker) if worker is not None else None

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = Headers(scope=scope).get("x-request-id", "")
        client_id = given if _REQUEST_ID.fullmatch(given) else None
        request_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["client_request_id"] = request_id, client_id
        echoed = client_id or request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = echoed
                if self._worker is not None:
                    headers["x-conduit-worker"] = self._worker
            await send(message)

        token = current_request_id.set(request_id)
        client_token = current_client_request_id.set(client_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_client_request_id.reset(client_token)
            current_request_id.reset(token)


class MetricsMiddleware(HttpMiddleware):
    """Count every response by route template and status; time it to its last byte."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status = ResponseStatus(send)
        try:
            await self.app(scope, receive, status.send)
        except Exception:
            status.code = 500
            raise
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, scope["method"], str(status.code)).inc()
            self.metrics.request_seconds.labels(route).observe(time.perf_counter() - started)


class InternalErrorMiddleware(HttpMiddleware):
    """Last resort: an unexpected exception becomes an OpenAI-shaped 500 (inside the request-id middleware,
    so even that response carries X-Request-Id)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = ResponseStatus(send)
        try:
            await self.app(scope, receive, status.send)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if status.started:
                raise
            await send_error(send, OpenAIError(500, "Internal server error.", type="server_error"))


class ApiKeyMiddleware(HttpMiddleware):
    """Require `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on paths under `prefix`
    when keys are configured; the key is looked up by its SHA-256 digest and the matched ApiKey (name,
    limits) goes to `request.state.api_key`. The API keys guard /v1 but the `exempt` paths; the admin keys,
    in a second instance, guard /admin and the LoRA load/unload paths (`prefix` may be several)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeyStore,
        prefix: str | tuple[str, ...] = "/v1",
        exempt: tuple[str, ...] = (),
    ) -> None:
        super().__init__(app)
        self._keys = keys
        self._prefixes = (prefix,) if isinstance(prefix, str) else prefix
        self._exempt = exempt

    def _guards(self, path: str) -> bool:
        if path in self._exempt:
            return False
        return any(path == prefix or path.startswith(prefix + "/") for prefix in self._prefixes)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._keys.enabled or not self._guards(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and headers.get("x-api-key"):
            scheme, token = "bearer", headers["x-api-key"]  # Anthropic's clients send the key here
        if scheme.lower() != "bearer" or not token.strip():
            await send_error(
                send, _unauthorized("You didn't provide an API key (Authorization: Bearer KEY).")
            )
            return
        key = self._keys.lookup(token.strip())
        if key is None:
            await send_error(send, _unauthorized("Incorrect API key provided."))
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


# The generation endpoints: what a key's requests per minute and concurrent requests count.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})


class KeyLimitsMiddleware(HttpMiddleware):
    """Count every generation request of a key (after ApiKeyMiddleware has matched it) against its
    requests per minute and its max_concurrent_requests when it arrives, before its body is read or
    checked: a request refused later (400, 404, 413, an engine's refusal) has counted all the same. Its
    concurrent slot is held until the response has ended, however it ends (the client leaving
    mid-stream included)."""

    def __init__(self, app: ASGIApp, limiter: RateLimiter) -> None:
        super().__init__(app)
        self._limiter = limiter

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get("state", {}).get("api_key")
        if key is None or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            self._limiter.arrive(key)
        except RateLimited as refused:
            await send_error(send, refused)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._limiter.leave(key)


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class BodyLimitMiddleware(HttpMiddleware):
    """Refuse request bodies over the limit with 413, and bodies that take longer than `timeout_s` to
    arrive with 408 (a client trickling its body must not hold a connection), before the app parses them.

    `limit`: bytes, or a function of the request path giving them (prompt_limits.body_limit)."""

    def __init__(self, app: ASGIApp, limit: int | Callable[[str], int], timeout_s: float = 30.0) -> None:
        super().__init__(app)
        self.limit_for: Callable[[str], int] = limit if callable(limit) else (lambda _path: limit)
        self.timeout_s = timeout_s

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_error(send, self._too_large(limit))
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read_body(receive, limit)
        except TimeoutError:
            await send_error(send, self._too_slow())
            return
        except _BodyTooLarge:
            await send_error(send, self._too_large(limit))
            return
        if body is None:
            return  # the client left
        scope[BODY_SCOPE_KEY] = body  # the routes' Request reads it from here (http/request_body.py)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            # After the body, hand through the real channel so disconnects are still seen.
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive, limit: int) -> bytes | None:
        # Read the body here (bounded), then replay it: chunked uploads have no length to check up front.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_slow(self) -> OpenAIError:
        return OpenAIError(
            408,
            f"The request body did not arrive within {self.timeout_s:g} seconds.",
            code="request_timeout",
            headers={"Connection": "close"},
        )

    def _too_large(self, limit: int) -> OpenAIError:
        return OpenAIError(
            413,
            f"Request body is larger than the limit of {limit} bytes.",
            code="request_too_large",
        )


class _BodyTooLarge(Exception):
    pass
