"""One trace across a disaggregated request: the real gateway app in front of a real prefill engine server
and a real decode engine server (1P+1D, each in this process with its own TracerProvider and the SDK's
in-memory exporter, as three services would have), driven by the openai SDK. The decode engine's KV pull
is an `engine.kv_transfer` span inside its Generate span, and the prefill engine serves it as a PullKv
span that continues the same trace. Both engines' metrics count the transfer."""

from __future__ import annotations

import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from conduit_common import tracing
from conduit_engine.config import (
    CacheConfig,
    DisaggregationConfig,
    EngineConfig,
    ModelConfig,
    ServerConfig,
    TelemetryConfig,
)
from conduit_engine.telemetry.tracing import KV_BLOCKS, KV_BYTES, KV_TRANSFER_ID
from tests.engine.support.server_thread import ServerThread
from tests.observability.test_tracing import (
    CLIENT_SPAN_ID,
    CLIENT_TRACE_ID,
    GENERATE,
    TRACEPARENT,
    Collector,
)
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.prometheus import scrape
from tests.support.stories import MODEL, PROMPT, PROMPT_IDS

pytestmark = pytest.mark.integration

PULL_KV = "conduit.engine.v1.Engine/PullKv"
KV_TRANSFER = "engine.kv_transfer"
MAX_TOKENS = 12


def _engine(stories_path, role: str, spans: Collector) -> ServerThread:
    config = EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=64),
        server=ServerConfig(host="127.0.0.1", port=0),
        disaggregation=DisaggregationConfig(role=role),
        telemetry=TelemetryConfig(metrics_port=0),
    )
    return ServerThread(config, tracer_provider=spans.provider).start()


@pytest.fixture(scope="module")
def collectors():
    return {name: Collector(f"conduit-{name}") for name in ("gateway", "prefill", "decode")}


@pytest.fixture(scope="module")
def pair(stories_path, collectors):
    prefill = _engine(stories_path, "prefill", collectors["prefill"])
    decode = _engine(stories_path, "decode", collectors["decode"])
    yield prefill, decode
    decode.stop()
    prefill.stop()


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id}


def test_the_kv_pull_continues_the_trace_from_the_gateway_through_both_engines(pair, collectors):
    prefill, decode = pair
    with GatewayThread(
        [],
        prefill_engines=(prefill.address,),
        decode_engines=(decode.address,),
        tracer_provider=collectors["gateway"].provider,
    ) as gateway:
        with openai.OpenAI(
            base_url=f"{gateway.url}/v1",
            api_key="unused",
            max_retries=0,
            default_headers={"traceparent": TRACEPARENT},
        ) as client:
            response = client.completions.with_raw_response.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
    request_id = response.headers["x-request-id"]
    assert response.parse().usage.completion_tokens == MAX_TOKENS

    wait_for(lambda: len(collectors["gateway"].spans()) == 1, "the gateway's span")
    wait_for(lambda: len(collectors["decode"].spans(GENERATE)) == 1, "the decode engine's Generate span")
    wait_for(lambda: len(collectors["prefill"].spans(PULL_KV)) == 1, "the prefill engine's PullKv span")
    wait_for(lambda: len(collectors["prefill"].spans(GENERATE)) == 1, "the prefill engine's Generate span")
    (http,) = collectors["gateway"].spans()
    prefill_spans, decode_spans = collectors["prefill"].spans(), collectors["decode"].spans()
    (prefill_generate,) = collectors["prefill"].spans(GENERATE)
    (decode_generate,) = collectors["decode"].spans(GENERATE)
    (pull_kv,) = collectors["prefill"].spans(PULL_KV)

    # One trace, the client's, in all three services.
    trace_id = int(CLIENT_TRACE_ID, 16)
    assert {s.context.trace_id for s in [http, *prefill_spans, *decode_spans]} == {trace_id}
    assert http.parent.span_id == int(CLIENT_SPAN_ID, 16)

    # gateway → each engine's Generate (remote parents through the gRPC metadata).
    for generate in (prefill_generate, decode_generate):
        assert generate.parent.span_id == http.context.span_id and generate.parent.is_remote
        assert generate.kind is SpanKind.SERVER
        assert generate.attributes[tracing.REQUEST_ID] == request_id
    assert prefill_generate.attributes[tracing.FINISH_REASONS] == ("kv_handoff",)
    assert decode_generate.attributes[tracing.FINISH_REASONS] == ("length",)
    assert set(_children(prefill_spans, prefill_generate)) == {"engine.queue", "engine.prefill"}

    # decode Generate → engine.kv_transfer (the pull) → the prefill engine's PullKv (remote parent).
    decode_children = _children(decode_spans, decode_generate)
    assert set(decode_children) == {KV_TRANSFER, "engine.queue", "engine.prefill", "engine.decode"}
    kv = decode_children[KV_TRANSFER]
    assert kv.kind is SpanKind.CLIENT and kv.status.status_code is StatusCode.UNSET
    assert pull_kv.parent.span_id == kv.context.span_id and pull_kv.parent.is_remote
    assert pull_kv.kind is SpanKind.SERVER and pull_kv.status.status_code is StatusCode.UNSET
    assert decode_generate.start_time <= kv.start_time <= kv.end_time <= decode_generate.end_time

    # The transfer's attributes: both sides name the same transfer, blocks and bytes.
    block_size = decode.server.config.cache.block_size
    blocks = -(-len(PROMPT_IDS) // block_size)  # the prompt's blocks; none were in the decode cache
    block_bytes = decode.server.async_engine.core.kv_layout.block_bytes
    assert kv.attributes[tracing.REQUEST_ID] == request_id
    assert kv.attributes["conduit.kv.peer"] == prefill.address
    assert kv.attributes[KV_TRANSFER_ID] == pull_kv.attributes[KV_TRANSFER_ID] != ""
    assert kv.attributes[KV_BLOCKS] == pull_kv.attributes[KV_BLOCKS] == blocks
    assert kv.attributes[KV_BYTES] == pull_kv.attributes[KV_BYTES] == blocks * block_bytes
    prefill.check_integrity()
    decode.check_integrity()

    # The metrics: the decode engine pulled the whole prompt once; the prefill engine holds nothing.
    decode_metrics, prefill_metrics = scrape(decode.metrics_url), scrape(prefill.metrics_url)
    assert decode_metrics.value("conduit_engine_kv_pulls_total") == 1
    assert decode_metrics.value("conduit_engine_kv_pulled_bytes_total") == blocks * block_bytes
    assert decode_metrics.value("conduit_engine_kv_saved_bytes_total") == 0
    assert prefill_metrics.value("conduit_engine_kv_transfers_pending") == 0
    assert prefill_metrics.value("conduit_engine_kv_blocks_pinned") == 0
    assert prefill_metrics.value("conduit_engine_kv_pulls_total") == 0
