"""The engine's spans: for each traced request a `conduit.engine.v1.Engine/Generate` span (a child of the
caller's `traceparent`) with `engine.queue`, `engine.prefill` and `engine.decode` children, plus the KV
transfer span the disaggregated flow opens with `kv_transfer_span`.

The request spans are written when the request ends, from the times in its `RequestRecord`, so a traced
request costs nothing while it runs. A request is traced when its GenerationRequest.trace_context is a
`RequestTrace` (the servicer sets one on every Generate while tracing is on); otherwise nothing happens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context

from conduit_common import tracing
from conduit_engine.observer import RequestRecord, StepRecord
from conduit_engine.sequence import FinishReason

GENERATE_SPAN = "conduit.engine.v1.Engine/Generate"
KV_TRANSFER_SPAN = "engine.kv_transfer"


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """What a traced GenerationRequest carries: the engine's tracer and the caller's context."""

    tracer: Tracer
    parent: Context


class EngineTracing:
    """Starts request traces (servicer) and writes their spans when requests end (an EngineObserver)."""

    def __init__(self, provider: TracerProvider, model: str) -> None:
        self.tracer = provider.get_tracer("conduit_engine")
        self.model = model
        # Records hold time.monotonic(); spans want epoch nanoseconds.
        self._epoch_offset = time.time() - time.monotonic()

    def request_trace(self, metadata: Any) -> RequestTrace:
        """The trace of a Generate call, a child of the `traceparent` in its gRPC `metadata` if any."""
        return RequestTrace(self.tracer, tracing.extract(tracing.trace_headers(metadata or ())))

    def on_step(self, record: StepRecord) -> None:
        pass  # steps are not spans: a step serves many requests

    def on_request_end(self, record: RequestRecord) -> None:
        trace = record.trace_context
        if not isinstance(trace, RequestTrace):
            return
        attributes = {
            tracing.REQUEST_ID: record.request_id,
            tracing.MODEL: self.model,
            tracing.INPUT_TOKENS: record.num_prompt_tokens,
            tracing.OUTPUT_TOKENS: record.num_generated_tokens,
            tracing.CACHED_TOKENS: record.num_cached_tokens,
            tracing.FINISH_REASONS: [record.finish_reason.value],
            tracing.PREEMPTIONS: record.num_preemptions,
            "rpc.system": "grpc",
            "rpc.service": "conduit.engine.v1.Engine",
            "rpc.method": "Generate",
        }
        span = self.tracer.start_span(
            GENERATE_SPAN,
            context=trace.parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self._ns(record.arrival),
        )
        inside = set_span_in_context(span)
        for name, start, end, extra in _phases(record):
            child = self.tracer.start_span(name, context=inside, attributes=extra, start_time=self._ns(start))
            child.end(end_time=self._ns(end))
        if record.finish_reason is FinishReason.ERROR:
            span.set_status(Status(StatusCode.ERROR, "the engine failed while generating"))
        span.end(end_time=self._ns(record.finished))

    def _ns(self, monotonic_seconds: float) -> int:
        return int((monotonic_seconds + self._epoch_offset) * 1e9)


def _phases(record: RequestRecord) -> Iterator[tuple[str, float, float, dict[str, int]]]:
    """(name, start, end, attributes) of the phases the request went through before it ended."""
    scheduled, first, end = record.first_scheduled, record.first_token, record.finished
    yield "engine.queue", record.arrival, scheduled if scheduled is not None else end, {}
    if scheduled is None:
        return
    prefill = {
        tracing.INPUT_TOKENS: record.num_prompt_tokens,
        tracing.CACHED_TOKENS: record.num_cached_tokens,
    }
    yield "engine.prefill", scheduled, first if first is not None else end, prefill
    if first is not None and (end > first or record.num_generated_tokens > 1):
        yield "engine.decode", first, end, {tracing.OUTPUT_TOKENS: record.num_generated_tokens}


@contextmanager
def _kv_span(trace: RequestTrace, attributes: Mapping[str, Any]) -> Iterator[Span]:
    with trace.tracer.start_as_current_span(
        KV_TRANSFER_SPAN, context=trace.parent, kind=SpanKind.CLIENT, attributes=dict(attributes)
    ) as span:
        yield span


def kv_transfer_span(
    trace_context: object | None,
    *,
    request_id: str,
    peer: str,
    num_blocks: int,
    num_bytes: int | None = None,
) -> Any:
    """Time a KV transfer of a request (disaggregated serving) as an `engine.kv_transfer` span.

    Call it where the decode engine pulls a prefill engine's KV blocks, with the GenerationRequest's
    `trace_context`:

        with kv_transfer_span(req.trace_context, request_id=req.request_id, peer=address, num_blocks=n):
            pull the blocks

    The span is a child of the caller's trace (beside the request's `Generate` span), CLIENT kind, with
    `conduit.request_id`, `conduit.kv.peer`, `conduit.kv.blocks` and `conduit.kv.bytes`; an exception
    escaping the block marks it failed. For an untraced request (trace_context None) it does nothing.
    The context manager yields the span (or None) so the caller may add attributes it learns later.
    """
    if not isinstance(trace_context, RequestTrace):
        return nullcontext(None)
    attributes: dict[str, Any] = {tracing.REQUEST_ID: request_id, "conduit.kv.peer": peer}
    attributes["conduit.kv.blocks"] = num_blocks
    if num_bytes is not None:
        attributes["conduit.kv.bytes"] = num_bytes
    return _kv_span(trace_context, attributes)
