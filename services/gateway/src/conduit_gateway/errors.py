"""OpenAI-shaped errors: the exception handlers raise, and the one table mapping gRPC status to HTTP.

Every error the gateway returns has the body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc

log = logging.getLogger(__name__)

# gRPC status → (HTTP status, OpenAI error type, error code). Anything not listed is a server error.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "engine_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.CANCELLED: (503, "server_error", "engine_cancelled"),
    # An engine older than the gateway (a rolling upgrade) lacks a newer RPC such as Detokenize.
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
}


class OpenAIError(Exception):
    """An error response: HTTP status plus the OpenAI error body fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_json(self) -> str:
        return json.dumps(self.body(), ensure_ascii=False)


def invalid_param(param: str, message: str) -> OpenAIError:
    """A 400 for one request field; the message names the field the way the engine's messages do."""
    return OpenAIError(400, f"{param}: {message}", param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def no_engine_ready(detail: str = "no engine is ready") -> OpenAIError:
    return OpenAIError(503, f"Service unavailable: {detail}", type="server_error", code="engine_unavailable")


def too_many_requests(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def from_rpc_error(
    error: grpc.aio.AioRpcError,
    retry_after_s: int,
    param_aliases: dict[str, str] | None = None,
) -> OpenAIError:
    """Translate an engine status into the HTTP error a client sees.

    The engine's INVALID_ARGUMENT messages start with the field name and ": " (e.g. "temperature: must be
    >= 0, got -1.0"); that field becomes `param`, renamed through `param_aliases` where the OpenAI name
    differs from the proto's (e.g. token_ids → prompt), and the message then starts with the new name.
    """
    code = error.code()
    details = error.details() or code.name
    status, type_, err_code = _GRPC_TO_HTTP.get(code, (500, "server_error", "engine_error"))
    param = None
    headers: dict[str, str] = {}
    if status == 400:
        field, sep, reason = details.partition(": ")
        if sep and field and " " not in field:
            param = (param_aliases or {}).get(field, field)
            if param != field:  # the message names the field the client sent, as `param` does
                details = f"{param}: {reason}"
    elif status == 404:
        param = "model"
    elif status == 429:
        headers["Retry-After"] = str(retry_after_s)
    elif status == 500:
        # What an engine says about its own failure (UNKNOWN, INTERNAL...) stays in the gateway's log.
        log.warning("engine error %s: %s", code.name, details)
        details = "The engine failed to process the request."
    return OpenAIError(status, details, type=type_, param=param, code=err_code, headers=headers)
