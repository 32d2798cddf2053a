"""The engine's spans: for each traced request a `conduit.engine.v1.Engine/Generate` span (a child of the
caller's `traceparent`) with `engine.queue`, `engine.prefill` and `engine.decode` children; in disaggregated
serving also the decode engine's `engine.kv_transfer` (CLIENT, a child of its Generate span, around the
pull) and the prefill engine's `conduit.engine.v1.Engine/PullKv` (SERVER, the pull's child through the
traceparent the pull carries), so one trace runs gateway → prefill engine and gateway → decode engine →
prefill engine.

The Generate span starts when the call arrives (so the pull can be its child) and is ended, with its
phases, when the request ends, from the times in its `RequestRecord`: a traced request does no span work
while it runs. A request is traced when its GenerationRequest.trace_context is a `RequestTrace` (the
servicer sets one on every Generate while tracing is on); otherwise nothing happens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context

from conduit_common import tracing
from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.observer import RequestRecord, StepRecord, clock

GENERATE_SPAN = "conduit.engine.v1.Engine/Generate"
PULL_KV_SPAN = "conduit.engine.v1.Engine/PullKv"
KV_TRANSFER_SPAN = "engine.kv_transfer"
_RPC = {"rpc.system": "grpc", "rpc.service": "conduit.engine.v1.Engine"}


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """What a traced GenerationRequest carries: the engine's tracer, the caller's context and the
    request's Generate span (started, ended when the request ends)."""

    tracer: Tracer
    parent: Context
    span: Span

    @property
    def context(self) -> Context:
        """The Generate span's context: the parent of the request's other spans."""
        return set_span_in_context(self.span, self.parent)


class EngineTracing:
    """Starts request traces (servicer) and writes their spans when requests end (an EngineObserver)."""

    def __init__(self, provider: TracerProvider, model: str) -> None:
        self.tracer = provider.get_tracer("conduit_engine")
        self.model = model
        # Records hold time.monotonic(); spans want epoch nanoseconds.
        self._epoch_offset = time.time() - time.monotonic()

    def request_trace(self, metadata: Any) -> RequestTrace:
        """The trace of a Generate call, a child of the `traceparent` in its gRPC `metadata` if any."""
        parent = tracing.extract(tracing.trace_headers(metadata or ()))
        span = self.tracer.start_span(
            GENERATE_SPAN,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={**_RPC, "rpc.method": "Generate"},
            start_time=self._ns(clock()),  # the clock of the request's phases: never after its arrival
        )
        return RequestTrace(self.tracer, parent, span)

    def pull_kv_span(self, metadata: Any, transfer_id: str) -> Span:
        """The span of a PullKv this engine serves, a child of the puller's `engine.kv_transfer` span."""
        return self.tracer.start_span(
            PULL_KV_SPAN,
            context=tracing.extract(tracing.trace_headers(metadata or ())),
            kind=SpanKind.SERVER,
            attributes={**_RPC, "rpc.method": "PullKv", KV_TRANSFER_ID: transfer_id},
        )

    def on_step(self, record: StepRecord) -> None:
        pass  # steps are not spans: a step serves many requests

    def on_request_end(self, record: RequestRecord) -> None:
        trace = record.trace_context
        if not isinstance(trace, RequestTrace):
            return
        span = trace.span
        span.set_attributes(
            {
                tracing.REQUEST_ID: record.request_id,
                tracing.MODEL: self.model,
                tracing.INPUT_TOKENS: record.num_prompt_tokens,
                tracing.OUTPUT_TOKENS: record.num_generated_tokens,
                tracing.CACHED_TOKENS: record.num_cached_tokens,
                tracing.FINISH_REASONS: [record.finish_reason.value],
                tracing.PREEMPTIONS: record.num_preemptions,
            }
        )
        inside = trace.context
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
    # A prefill engine's request ends at its first token: its choices decode on another engine.
    handoff = record.finish_reason is FinishReason.KV_HANDOFF
    if first is not None and not handoff and (end > first or record.num_generated_tokens > 1):
        yield "engine.decode", first, end, {tracing.OUTPUT_TOKENS: record.num_generated_tokens}


KV_TRANSFER_ID = "conduit.kv.transfer_id"
KV_BLOCKS = "conduit.kv.blocks"
KV_BYTES = "conduit.kv.bytes"


@contextmanager
def _kv_span(trace: RequestTrace, attributes: Mapping[str, Any]) -> Iterator[Span]:
    with trace.tracer.start_as_current_span(
        KV_TRANSFER_SPAN, context=trace.context, kind=SpanKind.CLIENT, attributes=dict(attributes)
    ) as span:
        yield span


def kv_transfer_span(
    trace_context: object | None,
    *,
    request_id: str,
    transfer_id: str,
    peer: str,
    num_blocks: int,
    num_bytes: int | None = None,
) -> AbstractContextManager[Span | None]:
    """Time a KV transfer of a request (disaggregated serving) as an `engine.kv_transfer` span.

    The decode engine's pull of a prefill engine's KV blocks runs inside it, with the GenerationRequest's
    `trace_context` (AsyncEngine does this). The span is a child of the request's Generate span, CLIENT
    kind, with `conduit.request_id`, `conduit.kv.transfer_id`, `conduit.kv.peer`, `conduit.kv.blocks` and
    `conduit.kv.bytes` (when known); an exception escaping the block marks it failed. For an untraced
    request it does nothing. It yields the span (or None): `span_metadata` turns it into the pull's
    trace context, `end_kv_transfer` records how the pull ended.
    """
    if not isinstance(trace_context, RequestTrace):
        return nullcontext(None)
    attributes: dict[str, Any] = {
        tracing.REQUEST_ID: request_id,
        KV_TRANSFER_ID: transfer_id,
        "conduit.kv.peer": peer,
        KV_BLOCKS: num_blocks,
    }
    if num_bytes is not None:
        attributes[KV_BYTES] = num_bytes
    return _kv_span(trace_context, attributes)


def span_metadata(span: Span | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes `span` the parent of the callee's spans (none for no span)."""
    if span is None:
        return ()
    return tuple(tracing.inject(set_span_in_context(span)))


def end_kv_transfer(span: Span | None, num_blocks: int | None, num_bytes: int | None) -> None:
    """What a transfer moved (None: it failed and the decode engine recomputes the prompt)."""
    if span is None:
        return
    if num_blocks is None or num_bytes is None:
        span.set_attribute("conduit.kv.recomputed", True)
        span.set_status(Status(StatusCode.ERROR, "the pull failed: the prompt is recomputed"))
        return
    span.set_attributes({KV_BLOCKS: num_blocks, KV_BYTES: num_bytes})
