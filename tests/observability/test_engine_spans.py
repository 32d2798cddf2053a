"""The engine's spans from RequestRecords (which phases a request's end leaves), and the KV transfer span
the disaggregated flow opens, read with the SDK's in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from conduit_common import tracing
from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.observer import RequestRecord, clock
from conduit_engine.telemetry import kv_transfer_span
from conduit_engine.telemetry.tracing import (
    KV_BLOCKS,
    KV_BYTES,
    KV_TRANSFER_ID,
    EngineTracing,
    end_kv_transfer,
    span_metadata,
)

pytestmark = pytest.mark.unit

PARENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def engine_tracing(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return EngineTracing(provider, "m")


def _record(trace, reason, *, scheduled=None, first=None, generated=0) -> RequestRecord:
    """A record whose times are seconds after `trace` started (the Generate span starts at the call)."""
    base = clock()
    scheduled = None if scheduled is None else base + scheduled - 10.0
    first = None if first is None else base + first - 10.0
    return RequestRecord(
        request_id="r",
        finish_reason=reason,
        num_prompt_tokens=5,
        num_generated_tokens=generated,
        num_cached_tokens=0,
        num_preemptions=0,
        arrival=base,
        first_scheduled=scheduled,
        first_token=first,
        finished=base + 2.0,
        trace_context=trace,
    )


def _names(exporter) -> list[str]:
    return sorted(span.name for span in exporter.get_finished_spans())


@pytest.mark.parametrize(
    ("record_times", "phases"),
    [
        ({}, ["engine.queue"]),  # aborted in the queue
        ({"scheduled": 10.5}, ["engine.prefill", "engine.queue"]),  # ended during prefill
        (
            {"scheduled": 10.5, "first": 12.0, "generated": 1},
            ["engine.prefill", "engine.queue"],
        ),  # handed off
        (
            {"scheduled": 10.5, "first": 11.0, "generated": 8},
            ["engine.decode", "engine.prefill", "engine.queue"],
        ),
    ],
)
def test_a_request_has_the_phases_it_went_through(engine_tracing, exporter, record_times, phases):
    trace = engine_tracing.request_trace(PARENT.items())
    engine_tracing.on_request_end(_record(trace, FinishReason.ABORT, **record_times))
    assert _names(exporter) == sorted([*phases, "conduit.engine.v1.Engine/Generate"])
    generate = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert generate.context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
    # Span times are the record's (monotonic seconds mapped to epoch nanoseconds): the request ended 2 s
    # after it arrived; the Generate span started at the call, before the arrival.
    queue = next(s for s in exporter.get_finished_spans() if s.name == "engine.queue")
    assert generate.end_time - queue.start_time == pytest.approx(2e9, abs=1e3)
    assert generate.start_time <= queue.start_time


def test_a_handed_off_request_has_no_decode_phase(engine_tracing, exporter):
    """A prefill engine's request ends some time after its first token, but its choices decode elsewhere."""
    trace = engine_tracing.request_trace(PARENT.items())
    engine_tracing.on_request_end(
        _record(trace, FinishReason.KV_HANDOFF, scheduled=10.5, first=11.0, generated=1)
    )
    assert _names(exporter) == ["conduit.engine.v1.Engine/Generate", "engine.prefill", "engine.queue"]


def test_an_engine_failure_marks_the_request_span_failed(engine_tracing, exporter):
    trace = engine_tracing.request_trace(())
    engine_tracing.on_request_end(_record(trace, FinishReason.ERROR, scheduled=10.5))
    generate = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert generate.status.status_code is StatusCode.ERROR
    assert generate.parent is None  # no traceparent came: the engine's span starts the trace
    assert generate.attributes[tracing.FINISH_REASONS] == ("error",)


def test_untraced_requests_make_no_spans(engine_tracing, exporter):
    engine_tracing.on_request_end(_record(None, FinishReason.STOP, scheduled=10.5, first=11.0, generated=3))
    assert exporter.get_finished_spans() == ()


def test_kv_transfer_span_is_a_child_of_the_requests_generate_span(engine_tracing, exporter):
    trace = engine_tracing.request_trace(PARENT.items())
    with kv_transfer_span(
        trace, request_id="r", transfer_id="t1", peer="10.0.0.7:50051", num_blocks=12
    ) as span:
        metadata = span_metadata(span)
        end_kv_transfer(span, 10, 4096)
    (kv,) = exporter.get_finished_spans()
    assert (kv.name, kv.kind) == ("engine.kv_transfer", SpanKind.CLIENT)
    assert kv.context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
    assert kv.parent.span_id == trace.span.get_span_context().span_id
    assert kv.attributes == {
        tracing.REQUEST_ID: "r",
        KV_TRANSFER_ID: "t1",
        "conduit.kv.peer": "10.0.0.7:50051",
        KV_BLOCKS: 10,  # what was pulled (blocks in the prefix cache are not)
        KV_BYTES: 4096,
    }
    # The pull's metadata names the span as the parent of the source's PullKv span.
    (pull_kv_parent,) = [value for key, value in metadata if key == "traceparent"]
    assert pull_kv_parent == f"00-{kv.context.trace_id:032x}-{kv.context.span_id:016x}-01"
    served = engine_tracing.pull_kv_span(metadata, "t1")
    served.end()
    assert served.parent.span_id == kv.context.span_id and served.kind is SpanKind.SERVER


def test_a_failed_kv_transfer_is_a_failed_span(engine_tracing, exporter):
    trace = engine_tracing.request_trace(())
    with (
        pytest.raises(ConnectionError),
        kv_transfer_span(trace, request_id="r", transfer_id="t", peer="p", num_blocks=1),
    ):
        raise ConnectionError("the prefill engine went away")
    with kv_transfer_span(trace, request_id="r", transfer_id="t", peer="p", num_blocks=1) as span:
        end_kv_transfer(span, None, None)  # the puller logged the failure; the prompt is recomputed
    raised, recomputed = exporter.get_finished_spans()
    assert raised.status.status_code is recomputed.status.status_code is StatusCode.ERROR
    assert raised.events[0].name == "exception"
    assert recomputed.attributes["conduit.kv.recomputed"] is True


def test_kv_transfer_span_of_an_untraced_request_does_nothing(exporter):
    with kv_transfer_span(None, request_id="r", transfer_id="t", peer="p", num_blocks=1) as span:
        assert span is None
        assert span_metadata(span) == ()
        end_kv_transfer(span, None, None)
    assert exporter.get_finished_spans() == ()
