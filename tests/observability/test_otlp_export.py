"""--otlp-endpoint on the real CLIs: an engine process and a gateway process export their spans over
OTLP/gRPC to a real receiver, and the spans form one trace with the client's traceparent."""

from __future__ import annotations

import openai
import pytest

from tests.support.otlp_receiver import OtlpReceiver
from tests.support.polling import wait_for
from tests.support.processes import start_engine, start_gateway
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.integration

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
# Export every 50 ms instead of the batch processor's default 5 s, so the test need not wait.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def test_both_services_export_one_trace_over_otlp(stories_path):
    with OtlpReceiver() as receiver:
        flags = ("--otlp-endpoint", receiver.endpoint)
        with start_engine(stories_path, *flags, env=FAST_EXPORT) as engine:
            with start_gateway(engine.address, *flags, env=FAST_EXPORT) as gateway:
                with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as client:
                    completion = client.completions.create(
                        model=MODEL,
                        prompt=PROMPT,
                        max_tokens=6,
                        temperature=0,
                        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"},
                    )

                def exported() -> bool:
                    services = {s.service for s in receiver.spans()}
                    return {"conduit-engine", "conduit-gateway"} <= services

                wait_for(exported, "spans of both services")
    spans = receiver.spans()
    by_name = {s.span.name: s for s in spans}
    http, generate = by_name["POST /v1/completions"], by_name["conduit.engine.v1.Engine/Generate"]
    assert http.service == "conduit-gateway" and generate.service == "conduit-engine"
    assert {s.span.trace_id.hex() for s in spans} == {TRACE_ID}
    assert http.span.parent_span_id.hex() == CLIENT_SPAN_ID
    assert generate.span.parent_span_id == http.span.span_id
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        assert by_name[phase].span.parent_span_id == generate.span.span_id
    assert generate.attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert http.attributes["conduit.request_id"] == generate.attributes["conduit.request_id"]
