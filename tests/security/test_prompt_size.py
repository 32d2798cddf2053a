"""Size before cost, as the attack: one tenant's prompts too long for the context (stories260K: 512
tokens, no token over 9 bytes, so 4,608 bytes of text at most) are refused by their size, before
anything tokenizes them, by the gateway on every API and by the engine over gRPC, with the status and
field of the too-long-prompt error; the engine's memory does not grow. The real engine and gateway
processes; nothing here is timed (bench/tenant_isolation.py measures what the other tenant sees).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import anthropic
import grpc
import httpx
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.support.processes import require_shared, start_engine, start_gateway
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

BOUND = 512 * 9  # the context × the longest vocabulary entry, in bytes
ATTACK = 8_000_000  # the measured attack: an 8 MB completions prompt
OVER = 200_000  # over the bound, under every body and message limit
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def stack():
    with start_engine(require_shared(f"models/{MODEL}")) as engine, start_gateway(engine.address) as gateway:
        yield engine, gateway


@pytest.fixture(scope="module")
def engine(stack):
    return stack[0]


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack[1].url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def stub(engine):
    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(engine.address, options=options) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def too_long(field: str, size: int) -> str:
    return (
        f"{field}: prompt is {size} bytes of text, more than the {BOUND} bytes the model's context of "
        "512 tokens can hold"
    )


def assert_refused(response: httpx.Response, param: str, size: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (param, too_long(param, size))


def test_the_engine_publishes_its_bound(stub):
    info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.max_prompt_bytes == BOUND


def test_an_8_mb_completions_prompt_is_refused_as_prompt(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "a" * ATTACK})
    assert_refused(response, "prompt", ATTACK)


def test_a_huge_prompt_string_refused_before_parsing_is_only_one_a_parser_would_see(http):
    # The gateway refuses an oversized plain prompt string before parsing the body (body_scan.py); a
    # body whose last "prompt" is short is what a JSON parser sees, and it is served.
    body = b'{"model": "%s", "max_tokens": 2, "prompt": "' % MODEL.encode()
    body += b"a" * 2_000_000 + b'", "prompt": "Once upon a time"}'
    served = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 2
    # The same attack in a list, or with an escape (whose text is at least a sixth of its raw bytes).
    listed = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a" * ATTACK]})
    assert_refused(listed, "prompt", ATTACK)
    escaped = http.post("/v1/completions", json={"model": MODEL, "prompt": "a" * ATTACK + "\n"})
    assert escaped.status_code == 400 and escaped.json()["error"]["param"] == "prompt"
    assert escaped.json()["error"]["message"] == too_long("prompt", ATTACK + 2).replace(
        f"is {ATTACK + 2} bytes", f"is at least {-(-(ATTACK + 2) // 6)} bytes"
    )


def test_completions_prompt_lists_and_token_arrays_are_refused(http):
    listed = http.post("/v1/completions", json={"model": MODEL, "prompt": ["Once", "b" * OVER]})
    assert_refused(listed, "prompt[1]", OVER)
    tokens = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 600})
    assert tokens.status_code == 400
    assert tokens.json()["error"]["param"] == "prompt"
    assert tokens.json()["error"]["message"].startswith("prompt: prompt has 600 tokens; the model's context")


def test_an_oversized_chat_message_is_refused_as_messages(stack):
    with openai.OpenAI(base_url=f"{stack[1].url}/v1", api_key="unused", max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "c" * OVER}])
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "messages"
    assert caught.value.body["message"] == too_long("messages", OVER)


def test_an_8_mb_chat_body_is_over_the_body_limit(http):
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "c" * ATTACK}]}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_responses_input_and_anthropic_messages_are_refused(stack, http):
    assert_refused(http.post("/v1/responses", json={"model": MODEL, "input": "r" * OVER}), "input", OVER)
    with anthropic.Anthropic(base_url=stack[1].url, api_key="unused", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "m" * OVER}]
            )
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["message"] == too_long("messages", OVER)


def test_an_oversized_tokenize_over_http_is_refused(http):
    assert_refused(http.post("/tokenize", json={"model": MODEL, "prompt": "t" * OVER}), "prompt", OVER)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "t" * OVER}]}
    assert_refused(http.post("/tokenize", json=chat), "messages", OVER)


def test_an_oversized_tokenize_over_grpc_is_refused_naming_the_field(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(engine_pb2.TokenizeRequest(text="t" * OVER))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == too_long("text", OVER)
    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content="t" * OVER)])
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(engine_pb2.TokenizeRequest(chat=chat))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("chat: prompt is ")


def test_an_oversized_generate_over_grpc_is_refused_as_prompt(stub):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(engine_pb2.GenerateRequest(text="g" * OVER)))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == too_long("prompt", OVER)


def test_a_30_mb_tokenize_is_over_the_engines_message_limit(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(engine_pb2.TokenizeRequest(text="t" * 30_000_000))
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_text_at_the_bound_is_tokenized_and_one_byte_more_is_not(stub, http):
    # 4,608 bytes: within the bound (its tokens are then counted as ever); one more byte is refused.
    at_bound = ("Once upon a time " * 300)[:BOUND]
    ids = stub.Tokenize(engine_pb2.TokenizeRequest(text=at_bound, ids_only=True)).token_ids
    assert 0 < len(ids) < 2000
    response = http.post("/tokenize", json={"model": MODEL, "prompt": at_bound})
    assert response.status_code == 200, response.text
    assert response.json()["count"] == len(ids)
    assert_refused(
        http.post("/tokenize", json={"model": MODEL, "prompt": at_bound + "é"}), "prompt", BOUND + 2
    )


def test_four_attacks_at_once_leave_the_engines_memory_flat(engine, stub, http):
    before = rss(engine.process.pid)

    def through_gateway() -> int:
        return http.post("/v1/completions", json={"model": MODEL, "prompt": "a" * ATTACK}).status_code

    def to_the_engine() -> grpc.StatusCode:
        try:
            list(stub.Generate(engine_pb2.GenerateRequest(text="a" * (4 * 1000 * 1000))))
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        gateway_calls = [pool.submit(through_gateway) for _ in range(4)]
        engine_calls = [pool.submit(to_the_engine) for _ in range(4)]
        assert [call.result() for call in gateway_calls] == [400] * 4
        assert [call.result() for call in engine_calls] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert rss(engine.process.pid) - before < 100 * 1000 * 1000
    # And the engine still serves.
    answer = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    )
    assert answer.status_code == 200
