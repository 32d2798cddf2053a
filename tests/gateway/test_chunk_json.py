"""The choices and logprobs the chat and completions handlers write by hand are the JSON of their dicts."""

from __future__ import annotations

import json

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers import chat, completions
from conduit_gateway.handlers.choices import token_offsets
from conduit_gateway.http.sse import ChunkEncoder, RawJson, json_string, json_value

pytestmark = pytest.mark.unit

TEXTS = [
    "",
    "plain",
    ' "quoted" \\ back',
    "tab\tnew\nline\r\x00\x1f\x7f",
    "é ü 日本 🙂",
    "</script>",
    "\u2028\u2029",
]
LOGPROBS = [-0.5, 0.0, -1e-07, -123456.789, float("-inf"), float("nan"), -3.4028234663852886e38]


def _position(text: str, logprob: float, top: int) -> engine_pb2.PositionLogprobs:
    return engine_pb2.PositionLogprobs(
        token=engine_pb2.TokenLogprob(token_id=7, text=text, logprob=logprob, rank=1),
        top=[
            engine_pb2.TokenLogprob(token_id=8 + k, text=f"{text}{k}", logprob=logprob - k, rank=k + 2)
            for k in range(top)
        ],
    )


def _encoded(choice: dict | RawJson) -> str:
    encoder = ChunkEncoder(
        id="chatcmpl-1", object="chat.completion.chunk", created=1, model="m", usage_mode="final"
    )
    return encoder.chunk([choice], dict)


@pytest.mark.parametrize("text", TEXTS)
def test_a_string_is_written_as_the_encoder_writes_it(text):
    assert json_string(text) == json.dumps(text, ensure_ascii=False)


@pytest.mark.parametrize("top", [0, 2])
@pytest.mark.parametrize("logprob", LOGPROBS)
def test_chat_logprob_entries_written_by_hand_equal_the_dicts_encoded(logprob, top):
    positions = [_position(text, logprob, top) for text in TEXTS]
    by_hand = RawJson(f'{{"content":[{chat._logprob_entries_json(positions)}],"refusal":null}}')
    as_dicts = {"content": chat._logprob_entries(positions), "refusal": None}
    assert _encoded(RawJson(by_hand)) == _encoded(as_dicts)  # type: ignore[arg-type]
    assert json.loads(by_hand) == json.loads(json.dumps(as_dicts))


def test_a_list_of_choices_mixing_raw_and_dicts_is_one_json_list():
    raw = RawJson('{"index":0,"text":"a"}')
    assert json.loads(_encoded(raw)[6:])["choices"] == [{"index": 0, "text": "a"}]
    encoder = ChunkEncoder(id="x", object="o", created=1, model="m", usage_mode="none")
    event = encoder.chunk([raw, {"index": 1, "text": "b"}], dict)
    assert json.loads(event[6:])["choices"] == [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]


@pytest.mark.parametrize("usage_mode", ["none", "final", "running"])
@pytest.mark.parametrize(
    "choice", [RawJson('{"index":0,"text":"a"}'), {"index": 0, "delta": {"content": "é\n"}, "logprobs": None}]
)
def test_one_choices_event_is_the_chunk_of_a_list_of_it(choice, usage_mode):
    encoder = ChunkEncoder(id="x", object="o", created=1, model="m", usage_mode=usage_mode)
    usage = {"prompt_tokens": 5, "completion_tokens": 1}
    assert encoder.one(choice, lambda: usage) == encoder.chunk([choice], lambda: usage)


@pytest.mark.parametrize("top", [0, 2])
@pytest.mark.parametrize("logprob", LOGPROBS)
def test_completions_logprobs_written_by_hand_equal_the_dict_encoded(logprob, top):
    positions = [_position(text, logprob, top) for text in TEXTS]
    # An alternative with the chosen token's text, and two alternatives with one text: the dict keeps one.
    positions[1].top.add(token_id=99, text=positions[1].token.text, logprob=-7.0, rank=9)
    positions[2].top.add(token_id=98, text="same", logprob=-8.0, rank=10)
    positions[2].top.add(token_id=97, text="same", logprob=-9.0, rank=11)
    text = "".join(position.token.text for position in positions)[:-3]  # shorter than the tokens' texts
    offsets = token_offsets(5, text, positions)
    assert completions._logprobs_json(positions, 5, text) == json_value(
        completions._logprobs(positions, offsets)
    )
