"""One trace across the gateway and the engine: the real gateway app and the real engine server in this
process, each with its own TracerProvider and the SDK's in-memory exporter (as two services would have),
driven by the openai SDK. Asserts the trace id, the parent/child structure and the attributes. The engine
requires a bearer token and the gateways an API key, so the trace context travels beside the token
through the engine's auth interceptor and the gateway's key check."""

from __future__ import annotations

import httpx
import openai
import pytest
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from conduit_common import tracing
from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, SecurityConfig, ServerConfig
from tests.engine.support.server_thread import ServerThread
from tests.support.gateway_thread import GatewayThread
from tests.support.polling import wait_for
from tests.support.stories import MODEL, PROMPT, PROMPT_IDS

pytestmark = pytest.mark.integration

# A client's own span: W3C traceparent version 00, sampled.
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
GENERATE = "conduit.engine.v1.Engine/Generate"
API_KEY = "sk-trace-test"


class Collector:
    """A service's TracerProvider whose finished spans stay in memory."""

    def __init__(self, service: str) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def clear(self) -> None:
        self.exporter.clear()


@pytest.fixture(scope="module")
def engine_spans():
    return Collector("conduit-engine")


@pytest.fixture(scope="module")
def gateway_spans():
    return Collector("conduit-gateway")


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text("engine-token-of-the-trace-tests\n")
    return str(path)


@pytest.fixture(scope="module")
def engine(stories_path, engine_spans, token_file):
    config = EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=64),
        server=ServerConfig(host="127.0.0.1", port=0),
        security=SecurityConfig(auth_token_file=token_file),
    )
    thread = ServerThread(config, tracer_provider=engine_spans.provider).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def traced_gateway(engine, gateway_spans, token_file):
    with GatewayThread(
        [engine.address],
        tracer_provider=gateway_spans.provider,
        api_keys=(API_KEY,),
        engine_auth_token_file=token_file,
    ) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def untraced_gateway(engine, token_file):
    with GatewayThread([engine.address], api_keys=(API_KEY,), engine_auth_token_file=token_file) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(engine_spans, gateway_spans):
    engine_spans.clear()
    gateway_spans.clear()


def _client(
    gateway: GatewayThread, headers: dict[str, str] | None = None, api_key: str = API_KEY
) -> openai.OpenAI:
    url = f"{gateway.url}/v1"
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, default_headers=headers)


def _complete(gateway: GatewayThread, headers: dict[str, str] | None = None, stream: bool = False):
    with _client(gateway, headers) as client:
        response = client.completions.with_raw_response.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        body = response.parse()
        if stream:
            body = list(body)
        return response.headers["x-request-id"], body


def _engine_trace(engine_spans: Collector) -> tuple[ReadableSpan, dict[str, ReadableSpan]]:
    wait_for(lambda: len(engine_spans.spans(GENERATE)) == 1, "the engine's Generate span")
    (generate,) = engine_spans.spans(GENERATE)
    children = {
        s.name: s
        for s in engine_spans.spans()
        if s.parent is not None and s.parent.span_id == generate.context.span_id
    }
    return generate, children


def test_one_trace_from_the_client_through_gateway_and_engine(traced_gateway, engine_spans, gateway_spans):
    echoed, completion = _complete(traced_gateway, {"traceparent": TRACEPARENT, "x-request-id": "client-1"})
    request_id = completion.id.removeprefix("cmpl-")  # the gateway's own id, the engine's request id
    assert echoed == "client-1" and request_id != echoed
    wait_for(lambda: len(gateway_spans.spans()) == 1, "the gateway's span")
    (http,) = gateway_spans.spans()
    generate, children = _engine_trace(engine_spans)

    # One trace: the client's. The gateway's span is the client span's child, the engine's the gateway's.
    trace_id = int(CLIENT_TRACE_ID, 16)
    assert http.context.trace_id == generate.context.trace_id == trace_id
    assert all(child.context.trace_id == trace_id for child in children.values())
    assert http.parent.span_id == int(CLIENT_SPAN_ID, 16) and http.parent.is_remote
    assert generate.parent.span_id == http.context.span_id and generate.parent.is_remote
    assert set(children) == {"engine.queue", "engine.prefill", "engine.decode"}
    queue, prefill, decode = (children[n] for n in ("engine.queue", "engine.prefill", "engine.decode"))
    assert generate.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
    assert prefill.end_time <= decode.start_time <= decode.end_time <= generate.end_time

    # Each service names itself, and the spans carry the request id, the model and the token counts.
    assert http.resource.attributes[SERVICE_NAME] == "conduit-gateway"
    assert generate.resource.attributes[SERVICE_NAME] == "conduit-engine"
    assert http.name == "POST /v1/completions" and http.kind is SpanKind.SERVER
    assert generate.kind is SpanKind.SERVER
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT_IDS), 12)
    for span in (http, generate):
        assert span.attributes[tracing.REQUEST_ID] == request_id
        assert span.attributes[tracing.MODEL] == MODEL
        assert span.attributes[tracing.INPUT_TOKENS] == usage.prompt_tokens
        assert span.attributes[tracing.OUTPUT_TOKENS] == usage.completion_tokens
    assert http.attributes[tracing.CLIENT_REQUEST_ID] == "client-1"
    assert http.attributes["http.response.status_code"] == 200
    assert http.attributes["http.route"] == "/v1/completions"
    assert generate.attributes[tracing.FINISH_REASONS] == ("length",)
    assert prefill.attributes[tracing.INPUT_TOKENS] == len(PROMPT_IDS)
    assert decode.attributes[tracing.OUTPUT_TOKENS] == 12


def test_the_gateway_starts_a_trace_when_the_client_sends_none(traced_gateway, engine_spans, gateway_spans):
    request_id, _ = _complete(traced_gateway, stream=True)
    wait_for(lambda: len(gateway_spans.spans()) == 1, "the gateway's span")
    (http,) = gateway_spans.spans()
    generate, children = _engine_trace(engine_spans)
    assert http.parent is None
    assert generate.context.trace_id == http.context.trace_id
    assert generate.parent.span_id == http.context.span_id
    assert http.attributes[tracing.OUTPUT_TOKENS] == generate.attributes[tracing.OUTPUT_TOKENS] == 12
    assert generate.attributes[tracing.REQUEST_ID] == http.attributes[tracing.REQUEST_ID] == request_id
    assert tracing.CLIENT_REQUEST_ID not in http.attributes  # the client sent no X-Request-Id
    assert len(children) == 3


def test_an_untraced_gateway_hands_the_clients_trace_context_to_the_engine(
    untraced_gateway, engine_spans, gateway_spans
):
    _complete(untraced_gateway, {"traceparent": TRACEPARENT, "tracestate": "vendor=value"})
    generate, _ = _engine_trace(engine_spans)
    assert gateway_spans.spans() == []
    assert generate.context.trace_id == int(CLIENT_TRACE_ID, 16)
    assert generate.parent.span_id == int(CLIENT_SPAN_ID, 16)
    assert generate.context.trace_state.get("vendor") == "value"


def test_a_refused_request_has_only_the_gateway_span(traced_gateway, engine_spans, gateway_spans):
    with _client(traced_gateway) as client, pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=-1)
    wait_for(lambda: len(gateway_spans.spans()) == 1, "the gateway's span")
    (http,) = gateway_spans.spans()
    assert http.attributes["http.response.status_code"] == 400
    assert engine_spans.spans(GENERATE) == []


def test_a_request_without_a_valid_key_is_traced_as_401_and_never_reaches_the_engine(
    traced_gateway, engine_spans, gateway_spans
):
    with _client(traced_gateway, api_key="sk-wrong") as client, pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    wait_for(lambda: len(gateway_spans.spans()) == 1, "the gateway's span")
    (http,) = gateway_spans.spans()
    assert http.attributes["http.response.status_code"] == 401
    assert engine_spans.spans(GENERATE) == []


def test_probes_and_scrapes_are_not_traced(traced_gateway, gateway_spans):
    for path in ("/health", "/metrics"):
        assert (
            httpx.get(f"{traced_gateway.url}{path}", headers={"traceparent": TRACEPARENT}).status_code == 200
        )
    with _client(traced_gateway) as client:
        client.models.list()
    wait_for(lambda: len(gateway_spans.spans()) == 1, "the span of GET /v1/models")
    assert [s.name for s in gateway_spans.spans()] == ["GET /v1/models"]


def test_a_streamed_messages_request_is_one_trace_too(traced_gateway, engine_spans, gateway_spans):
    import anthropic

    headers = {"traceparent": TRACEPARENT}
    with anthropic.Anthropic(
        base_url=traced_gateway.url, api_key=API_KEY, max_retries=0, default_headers=headers
    ) as client:
        messages = [{"role": "user", "content": PROMPT}]
        with client.messages.stream(model=MODEL, max_tokens=12, messages=messages) as stream:
            message = stream.get_final_message()
    wait_for(lambda: len(gateway_spans.spans()) == 1, "the gateway's span")
    (http,) = gateway_spans.spans()
    generate, _ = _engine_trace(engine_spans)
    assert http.context.trace_id == generate.context.trace_id == int(CLIENT_TRACE_ID, 16)
    assert generate.parent.span_id == http.context.span_id
    assert http.name == "POST /v1/messages" and http.attributes["http.route"] == "/v1/messages"
    assert http.attributes["http.response.status_code"] == 200
    usage = message.usage
    assert http.attributes[tracing.MODEL] == MODEL
    assert http.attributes[tracing.INPUT_TOKENS] == usage.input_tokens + usage.cache_read_input_tokens
    assert http.attributes[tracing.OUTPUT_TOKENS] == usage.output_tokens
