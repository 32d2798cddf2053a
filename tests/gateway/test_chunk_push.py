"""ChunkPush (handlers/chunk_push.py) on plain objects: what it takes, what it leaves to the read loop, the
context its events are made in, and the text events it writes itself (the same bytes the handlers' hooks
make); Relayed's layers, for whole messages and for messages that only add tokens."""

from __future__ import annotations

import contextvars
from types import SimpleNamespace

import pytest

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.chat import _content_delta, _content_parts
from conduit_gateway.handlers.choices import ChoiceState
from conduit_gateway.handlers.chunk_push import ChunkPush, TextEvents
from conduit_gateway.handlers.completions import CompletionsHandler, _text_parts
from conduit_gateway.http.sse import ChunkEncoder, json_string
from conduit_gateway.routing.generate_mux import Relayed

pytestmark = pytest.mark.unit

REQUEST = contextvars.ContextVar("request", default=None)
# What CompletionsHandler.delta_choice reads of its handler, for a request without logprobs.
COMPLETIONS_WITHOUT_LOGPROBS = SimpleNamespace(body=SimpleNamespace(logprobs=None))


class Writer:
    """The body writer's side ChunkPush uses."""

    def __init__(self) -> None:
        self.writable_now = True
        self.behind = False
        self.written: list[bytes] = []

    @property
    def keeping_up(self) -> bool:
        return self.writable_now and not self.behind

    def write_now(self, body: bytes) -> None:
        self.written.append(body)

    def write_parts_now(self, head: bytes, body: bytes, tail: bytes) -> None:
        self.written.append(head + body + tail)


def test_a_plain_message_is_shaped_in_the_handlers_context_and_written():
    writer, seen = Writer(), []

    def events(message: engine_pb2.GenerateResponse) -> str:
        seen.append(REQUEST.get())
        return f"data: {message.text}\n\n"

    token = REQUEST.set("req-1")
    push = ChunkPush(events, writer, n=1)  # made in the handler's task
    REQUEST.reset(token)
    message = engine_pb2.GenerateResponse(text="§")
    assert push.accepts(message)
    push.take(message)  # taken in another task's context
    assert seen == ["req-1"]
    assert writer.written == ["data: §\n\n".encode()]


def test_what_the_read_loop_keeps():
    writer = Writer()
    push = ChunkPush(lambda message: "", writer, n=2)
    assert push.accepts(engine_pb2.GenerateResponse(index=1))
    assert not push.accepts(engine_pb2.GenerateResponse(finished=True))  # a choice's last message
    assert not push.accepts(engine_pb2.GenerateResponse(index=2))  # a bad index: an error event
    writer.behind = True  # a slow client: merged by the read loop
    assert not push.accepts(engine_pb2.GenerateResponse())
    writer.behind, writer.writable_now = False, False  # the connection takes no more, or is gone
    assert not push.accepts(engine_pb2.GenerateResponse())
    push.take(engine_pb2.GenerateResponse())
    assert writer.written == []  # no events, nothing written


class Counted:
    """What TextEvents.count is given."""

    def __init__(self) -> None:
        self.messages: list[engine_pb2.GenerateResponse] = []

    def __call__(self, message: engine_pb2.GenerateResponse) -> None:
        self.messages.append(message)


def test_once_the_choice_is_open_text_messages_are_written_between_the_handlers_parts():
    writer, counted, texts = Writer(), Counted(), []
    shapes = iter([None, TextEvents(b'data: {"t":', b"}\n\n", texts, counted)])
    push = ChunkPush(
        lambda message: f"data: {message.text}\n\n", writer, n=1, text_events=lambda: next(shapes)
    )
    assert not push.takes_tokens
    push.take(engine_pb2.GenerateResponse(text="a"))  # the opening: the handler's events, then asked
    assert not push.takes_tokens
    push.take(engine_pb2.GenerateResponse(text="b"))  # asked again: now it answers
    assert push.takes_tokens
    quoted = engine_pb2.GenerateResponse(text='"§"', token_ids=[7])
    push.take_tokens(quoted, quoted.token_ids, quoted.text)
    empty = engine_pb2.GenerateResponse(token_ids=[8])  # a token whose text the engine holds back
    push.take_tokens(empty, empty.token_ids, empty.text)
    assert writer.written == [b"data: a\n\n", b"data: b\n\n", 'data: {"t":"\\"§\\""}\n\n'.encode()]
    assert texts == ['"§"']
    assert counted.messages == [quoted, empty]  # every message's usage is taken


def test_relayed_layers_run_innermost_first_for_whole_messages_and_for_token_messages():
    seen: list[str] = []

    class Layer:
        def __init__(self, name: str) -> None:
            self.name = name

        def relay(self, message: engine_pb2.GenerateResponse) -> engine_pb2.GenerateResponse:
            seen.append(f"{self.name} relay {message.text}")
            return message

        def relay_tokens(self, message: engine_pb2.GenerateResponse, token_ids, text: str) -> None:
            seen.append(f"{self.name} tokens {text} {list(token_ids)}")

    class Taker:
        takes_tokens = False

        def accepts(self, message: engine_pb2.GenerateResponse) -> bool:
            return True

        def take(self, message: engine_pb2.GenerateResponse) -> None:
            seen.append(f"take {message.text}")

        def take_tokens(self, message: engine_pb2.GenerateResponse, token_ids, text: str) -> None:
            seen.append(f"take_tokens {text}")

    outer, inner, taker = Layer("outer"), Layer("inner"), Taker()
    # As the layers build it: the outer stream wraps the push, then hands it to the inner stream.
    pushed = Relayed(Relayed(taker, outer.relay, outer.relay_tokens), inner.relay, inner.relay_tokens)
    assert pushed.accepts(engine_pb2.GenerateResponse())
    pushed.take(engine_pb2.GenerateResponse(text="a", token_ids=[1]))
    taker.takes_tokens = True
    pushed.take(engine_pb2.GenerateResponse(text="b", token_ids=[2]))
    assert seen == [
        "inner relay a",
        "outer relay a",
        "take a",
        "inner tokens b [2]",
        "outer tokens b [2]",
        "take_tokens b",
    ]


@pytest.mark.parametrize("usage_mode", ["none", "final"])
@pytest.mark.parametrize("text", ["§", 'a "quoted"\nline', ""])
def test_a_text_event_is_the_event_the_handlers_hooks_make(usage_mode, text):
    encoder = ChunkEncoder(
        id="chatcmpl-1", object="chat.completion.chunk", created=1, model="m", usage_mode=usage_mode
    )
    usage = dict  # not called without running usage
    before, after = encoder.text_event(*_content_parts(0, "null"))
    assert before + json_string(text) + after == encoder.one(_content_delta(0, text, []), usage)
    before, after = encoder.text_event(*_text_parts(2, "null"))
    choice = ChoiceState(2, prefix_sent=True)
    completion = CompletionsHandler.delta_choice(COMPLETIONS_WITHOUT_LOGPROBS, choice, text, [])
    assert before + json_string(text) + after == encoder.one(completion, usage)


def test_running_usage_has_no_text_event():
    encoder = ChunkEncoder(id="c", object="text_completion", created=1, model="m", usage_mode="running")
    assert encoder.text_event("{", "}") is None


def test_a_choice_whose_text_always_needs_the_handlers_hooks_stops_being_asked_about():
    writer, asked = Writer(), []

    def never():
        asked.append(1)
        return False

    push = ChunkPush(lambda message: f"data: {message.text}\n\n", writer, n=1, text_events=never)
    for text in ("a", "b", "c"):
        push.take(engine_pb2.GenerateResponse(text=text))
    assert asked == [1]  # the first answer holds
    assert not push.takes_tokens
    assert writer.written == [b"data: a\n\n", b"data: b\n\n", b"data: c\n\n"]
