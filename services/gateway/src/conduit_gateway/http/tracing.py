"""The gateway's part of a trace: a SERVER span per API request (/v1/...), and the W3C trace context that
the request's engine calls carry in their gRPC metadata (`engine_trace_metadata`).

With tracing on, the span is a child of the request's `traceparent` (or a new root) and the engines get
the span's own context. With tracing off nothing is started: an incoming `traceparent`/`tracestate` is
handed to the engines unchanged, so a traced engine still joins the client's trace.
"""

from __future__ import annotations

from contextvars import ContextVar

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, set_span_in_context
from starlette.types import ASGIApp, Receive, Scope, Send

from conduit_common import tracing
from conduit_gateway.http.middleware import HttpMiddleware, ResponseStatus

# The W3C headers the current request's engine calls send (empty: none).
_engine_trace_metadata: ContextVar[tuple[tuple[str, str], ...]] = ContextVar(
    "conduit_engine_trace_metadata", default=()
)


def engine_trace_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata entries carrying the current request's trace context to an engine."""
    return _engine_trace_metadata.get()


class TracingMiddleware(HttpMiddleware):
    """Spans for /v1 requests when `tracer` is given; trace-context pass-through otherwise."""

    def __init__(self, app: ASGIApp, tracer: Tracer | None) -> None:
        super().__init__(app)
        self.tracer = tracer

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        incoming = tracing.trace_headers(scope["headers"])
        if self.tracer is None or not scope["path"].startswith("/v1/"):
            token = _engine_trace_metadata.set(tuple(incoming.items()))
            try:
                await self.app(scope, receive, send)
            finally:
                _engine_trace_metadata.reset(token)
            return
        await self._traced(scope, receive, send, incoming)

    async def _traced(self, scope: Scope, receive: Receive, send: Send, incoming: dict[str, str]) -> None:
        assert self.tracer is not None
        method = scope["method"]
        state = scope.get("state", {})
        attributes = {
            "http.request.method": method,
            "url.path": scope["path"],
            tracing.REQUEST_ID: state.get("request_id", ""),
        }
        if state.get("client_request_id"):
            attributes[tracing.CLIENT_REQUEST_ID] = state["client_request_id"]
        span = self.tracer.start_span(
            method,  # renamed "METHOD /route" once the router has matched the route
            context=tracing.extract(incoming),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        inside = set_span_in_context(span)
        attached = otel_context.attach(inside)
        metadata = _engine_trace_metadata.set(tuple(tracing.inject(inside)))
        status = ResponseStatus(send)
        try:
            await self.app(scope, receive, status.send)
        except Exception as exc:
            status.code = 500
            span.record_exception(exc)
            raise
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is not None:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", status.code)
            if status.code >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
            _engine_trace_metadata.reset(metadata)
            otel_context.detach(attached)
