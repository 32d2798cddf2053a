"""A real OTLP/gRPC trace receiver on 127.0.0.1 (what an OpenTelemetry Collector listens with on 4317),
keeping every span it is sent, with its service's name."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

__all__ = ["OtlpReceiver", "ReceivedSpan"]


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def attributes(self) -> dict[str, object]:
        values = {}
        for item in self.span.attributes:
            kind = item.value.WhichOneof("value")
            values[item.key] = getattr(item.value, kind) if kind is not None else None
        return values


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`endpoint` is what --otlp-endpoint takes."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(service, span) for span in scope_spans.spans]
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.stop(grace=None)
