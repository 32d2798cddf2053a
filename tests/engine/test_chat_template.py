"""Chat templates get what transformers gives them, and a template that fails is the caller's 400.

The rendering is compared with transformers' own apply_chat_template on the same folder: special-token
variables, tools and documents, raise_exception, strftime_now, loop controls, tojson's arguments and
the {% generation %} block.
"""

from __future__ import annotations

import json
import shutil

import grpc
import openai
import pytest
import transformers

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc
from conduit_engine.entrypoints.proto_mapping import request_from_pb
from conduit_engine.errors import InvalidRequestError, ModelLoadError
from conduit_engine.models.tokenizer import ChatMessage, ModelTokenizer
from tests.engine.support.harness import make_engine
from tests.support.processes import start_engine, start_gateway

pytestmark = pytest.mark.integration

RICH_TEMPLATE = """{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}
{% for t in tools %}{% if loop.index > 2 %}{% break %}{% endif %}- {{ t['function']['name'] }}
{% endfor %}{% endif %}{% if documents %}{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}
{% endfor %}{% endif %}Year {{ strftime_now('%Y') }}
{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}\
{% if m['content'] == 'forbidden' %}{{ raise_exception('the word forbidden is not allowed') }}{% endif %}\
{{ m['role'] }}: {% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}\
{{ {'é': [1, 2]} | tojson(indent=1, sort_keys=True) }}"""

TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Wetter in München", "parameters": {}},
    },
    {"type": "function", "function": {"name": "clock", "parameters": {}}},
    {"type": "function", "function": {"name": "never_listed", "parameters": {}}},
]
DOCUMENTS = [{"title": "Lily", "text": "She loved the park."}, {"title": "Ball", "text": "It was red."}]
MESSAGES = [
    {"role": "system", "content": "skipped by the template"},
    {"role": "user", "content": "Where is the ball?"},
    {"role": "assistant", "content": "In the park."},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory, stories_path):
    folder = tmp_path_factory.mktemp("rich") / "stories"
    shutil.copytree(stories_path, folder)
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    return folder


def ours(folder, messages, **extras) -> str:
    return ModelTokenizer(folder).render_chat([ChatMessage(**m) for m in messages], True, **extras)


def test_rendering_equals_transformers(model):
    hf = transformers.AutoTokenizer.from_pretrained(model)
    for extras in ({}, {"tools": TOOLS}, {"documents": DOCUMENTS}, {"tools": TOOLS, "documents": DOCUMENTS}):
        want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **extras)
        assert ours(model, MESSAGES, **extras) == want, extras
    text = ours(model, MESSAGES, tools=TOOLS)
    assert text.startswith("<s>Tools: ") and "München" in text and "never_listed\n" not in text
    assert 'assistant:{\n "é": [\n  1,\n  2\n ]\n}' in text


def test_a_template_that_raises_is_an_invalid_argument_naming_messages(model):
    with pytest.raises(InvalidRequestError) as err:
        ours(model, [{"role": "user", "content": "forbidden"}])
    assert err.value.field == "messages"
    assert (
        str(err.value) == "messages: chat template rejected the messages: the word forbidden is not allowed"
    )


def test_a_template_with_a_type_error_is_an_invalid_argument_naming_messages(tmp_path, stories_path):
    folder = tmp_path / "m"
    shutil.copytree(stories_path, folder)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(InvalidRequestError, match="^messages: chat template rejected the messages: "):
        ours(folder, [{"role": "user", "content": "hi"}])


def test_a_template_that_does_not_parse_fails_at_start(tmp_path, stories_path):
    folder = tmp_path / "m"
    shutil.copytree(stories_path, folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(ModelLoadError, match="the chat template does not parse"):
        make_engine(folder)


def chat_request(**fields) -> pb.GenerateRequest:
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hi")], **fields)
    return pb.GenerateRequest(request_id="r", chat=chat, sampling=pb.SamplingParams(max_tokens=2))


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"tools_json": "[{"}, "chat.tools_json", "is not valid JSON"),
        ({"tools_json": '{"type": "function"}'}, "chat.tools_json", "must be a JSON array, got dict"),
        ({"documents_json": "nope"}, "chat.documents_json", "is not valid JSON"),
        ({"documents_json": "3"}, "chat.documents_json", "must be a JSON array, got int"),
    ],
)
def test_bad_tools_or_documents_json_names_the_field(fields, field, message):
    with pytest.raises(InvalidRequestError) as err:
        request_from_pb(chat_request(**fields))
    assert err.value.field == field and message in str(err.value)


def test_tools_and_documents_reach_the_template_through_the_proto(model):
    req = request_from_pb(chat_request(tools_json=json.dumps(TOOLS), documents_json=json.dumps(DOCUMENTS)))
    assert (req.tools, req.documents) == (TOOLS, DOCUMENTS)
    engine = make_engine(model)
    prompt = engine.admission.prompt_token_ids(req)
    text = engine.tokenizer.decode(prompt, skip_special_tokens=False)
    assert "- weather" in text and "[Ball] It was red." in text


def test_grpc_and_the_gateway_map_template_errors_to_invalid_argument_and_400(model):
    with start_engine(model) as engine:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            forbidden = pb.GenerateRequest(
                chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="forbidden")]),
                sampling=pb.SamplingParams(max_tokens=2),
            )
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(forbidden, timeout=30))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("messages: chat template rejected the messages: the word")
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(chat_request(tools_json="[{"), timeout=30))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("chat.tools_json: is not valid JSON")
            tokenized = stub.Tokenize(
                pb.TokenizeRequest(chat=chat_request(tools_json=json.dumps(TOOLS)).chat)
            )
            assert "weather" in "".join(tokenized.tokens)
        with start_gateway(engine.address) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as bad:
                client.chat.completions.create(
                    model="stories", messages=[{"role": "user", "content": "forbidden"}], max_tokens=2
                )
    assert bad.value.status_code == 400
    error = bad.value.body if isinstance(bad.value.body, dict) else {}
    assert error.get("param") == "messages"
    assert "the word forbidden is not allowed" in error.get("message", "")
