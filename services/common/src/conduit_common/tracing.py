"""OpenTelemetry set-up both services share: a TracerProvider that exports over OTLP/gRPC, the W3C trace
context in and out of carriers (HTTP headers, gRPC metadata), and the span attribute names.

Tracing is off unless --otlp-endpoint is given: a service then holds no tracer (None) and does no tracing
work beyond handing an incoming `traceparent` on unchanged. Only the W3C Trace Context headers are read
and written (`traceparent`, `tracestate`), whatever OTEL_PROPAGATORS says, so both services always agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_HEADERS = ("traceparent", "tracestate")

# Span attributes: OpenTelemetry's GenAI and HTTP conventions where one exists, conduit.* otherwise.
REQUEST_ID = "conduit.request_id"
CLIENT_REQUEST_ID = "conduit.client_request_id"  # the client's X-Request-Id, when it sent one
MODEL = "gen_ai.request.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "conduit.usage.cached_input_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
PREEMPTIONS = "conduit.preemptions"

_PROPAGATOR = TraceContextTextMapPropagator()


def check_otlp_endpoint(endpoint: str, flag: str = "--otlp-endpoint") -> None:
    """Raise ValueError naming `flag` unless `endpoint` reads http(s)://HOST:PORT (an OTLP/gRPC receiver)."""
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(
            f"{flag}: expected http://HOST:PORT or https://HOST:PORT (OTLP over gRPC, usually port 4317), "
            f"got {endpoint!r}"
        )


def otlp_tracer_provider(service_name: str, endpoint: str) -> TracerProvider:
    """Spans batched to the OTLP/gRPC receiver at `endpoint` (plaintext for http://, TLS for https://).

    `service_name` is the resource's service.name unless OTEL_SERVICE_NAME sets another;
    OTEL_RESOURCE_ATTRIBUTES adds attributes as usual.
    """
    # Imported here: a service without --otlp-endpoint never loads the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    detected = OTELResourceDetector().detect()
    name = detected.attributes.get(SERVICE_NAME) or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme == "http")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def extract(carrier: Mapping[str, str]) -> Context:
    """The remote parent in `carrier`'s W3C headers (an empty context when there is none or it is bad)."""
    return _PROPAGATOR.extract(carrier)


def inject(context: Context) -> list[tuple[str, str]]:
    """The W3C headers of `context`'s current span, as (key, value) pairs for gRPC metadata."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return list(carrier.items())


def trace_headers(pairs: Iterable[tuple[str | bytes, str | bytes]]) -> dict[str, str]:
    """The W3C trace headers among `pairs` (ASGI headers in bytes, or gRPC metadata), keys lower-cased."""
    found: dict[str, str] = {}
    for key, value in pairs:
        name = (key.decode("latin-1") if isinstance(key, bytes) else key).lower()
        if name in TRACE_HEADERS:
            found[name] = value.decode("latin-1") if isinstance(value, bytes) else value
    return found
