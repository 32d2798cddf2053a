"""What makes the /v1/messages paths speak Anthropic's HTTP dialect around the shared gateway: error bodies
`{"type": "error", "error": {"type", "message"}, "request_id"}` with Anthropic's error types and status
codes (503 becomes 529 overloaded_error), the rate-limit headers under Anthropic's names beside OpenAI's,
and the `request-id` header. /v1/models speaks it too when the request carries `anthropic-version` (as
the anthropic SDKs' requests do): its lists and errors are then Anthropic's.

One pure-ASGI middleware rewrites every error response of those paths, whoever raised it (validation,
API keys, body limits, the handler, the last-resort 500), so the rest of the gateway stays OpenAI-shaped.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import Message, Receive, Scope, Send

from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.middleware import HttpMiddleware

PREFIX = "/v1/messages"
MODELS = "/v1/models"
VERSION_HEADER = "anthropic-version"
OVERLOADED = 529

# HTTP status → Anthropic error type (their API reference's table; 529 is where this gateway says 503).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    504: "timeout_error",
    OVERLOADED: "overloaded_error",
}
_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def anthropic_status(status: int) -> int:
    return OVERLOADED if status == 503 else status


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error body for an error the gateway answers with `status` (before the 503 → 529)."""
    status = anthropic_status(status)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def stream_error_event(error: OpenAIError, request_id: str | None = None) -> str:
    """An `error` event inside a started stream (the anthropic SDKs raise it as an APIStatusError)."""
    data = json.dumps(error_body(error.status, error.message, request_id), ensure_ascii=False)
    return f"event: error\ndata: {data}\n\n"


def go_duration_seconds(text: str) -> float | None:
    """Seconds of a Go duration as the x-ratelimit-reset-* headers spell it (6m0s, 8.64s, 17ms)."""
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        return None
    return sum(float(number) * _UNIT_S[unit] for number, unit in parts)


def rfc3339_after(seconds: float, now: datetime | None = None) -> str:
    """The moment `seconds` from now, as Anthropic's *-reset headers give it (whole seconds, UTC)."""
    moment = (now or datetime.now(UTC)) + timedelta(seconds=math.ceil(seconds))
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_limit_headers(headers: MutableHeaders) -> None:
    """Add anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset} beside x-ratelimit-*."""
    for kind in ("requests", "tokens"):
        for field in ("limit", "remaining", "reset"):
            value = headers.get(f"x-ratelimit-{field}-{kind}")
            if value is None:
                continue
            if field == "reset":
                seconds = go_duration_seconds(value)
                if seconds is None:
                    continue
                value = rfc3339_after(seconds)
            headers[f"anthropic-ratelimit-{kind}-{field}"] = value


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def speaks_anthropic(scope: Scope) -> bool:
    """The Messages API's paths, and /v1/models asked by an Anthropic client."""
    path = scope["path"]
    return _under(path, PREFIX) or (_under(path, MODELS) and VERSION_HEADER in Headers(scope=scope))


def model_info(name: str, created_unix: int, max_input_tokens: int | None) -> dict[str, Any]:
    """A served model as Anthropic's ModelInfo."""
    created = datetime.fromtimestamp(created_unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    info: dict[str, Any] = {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": created,
        "lifecycle": "active",
    }
    if max_input_tokens is not None:
        info["max_input_tokens"] = max_input_tokens
    return info


def model_page(models: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's page of models: every served model on one page."""
    return {
        "data": models,
        "has_more": False,
        "first_id": models[0]["id"] if models else None,
        "last_id": models[-1]["id"] if models else None,
    }


class AnthropicApiMiddleware(HttpMiddleware):
    """On the paths that speak Anthropic's dialect: its error bodies and status codes, and its headers."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not speaks_anthropic(scope):
            await self.app(scope, receive, send)
            return
        request_id = scope.get("state", {}).get("request_id")
        held: Message | None = None  # the start of an error response, sent with its rewritten body
        chunks: list[bytes] = []

        async def send_anthropic(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                anthropic_limit_headers(headers)
                if request_id is not None:
                    headers["request-id"] = request_id
                if message["status"] >= 400:
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start, held = held, None
                await self._send_error(send, start, b"".join(chunks), request_id)
                return
            await send(message)

        await self.app(scope, receive, send_anthropic)

    async def _send_error(self, send: Send, start: Message, body: bytes, request_id: str | None) -> None:
        status = start["status"]
        try:
            error = json.loads(body)["error"]
            message = error["message"] if isinstance(error, dict) else str(error)
        except (ValueError, KeyError, TypeError):
            message = body.decode("utf-8", "replace") or f"HTTP {status}"
        payload = json.dumps(error_body(status, message, request_id), ensure_ascii=False).encode("utf-8")
        headers = MutableHeaders(scope=start)
        headers["content-type"] = "application/json"
        headers["content-length"] = str(len(payload))
        start["status"] = anthropic_status(status)
        await send(start)
        await send({"type": "http.response.body", "body": payload})
