"""The Messages API's pure parts, in process: content blocks built from parsed output (chunk-invariant: any
split of the text gives the same blocks, and the events add up to them), the thinking budget's two-part
stream, and Anthropic's rate-limit header spellings."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from starlette.datastructures import MutableHeaders

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.message_blocks import MessageBlocks, sse
from conduit_gateway.handlers.thinking_budget import BudgetedStream, ThinkingBudget
from conduit_gateway.http.anthropic import (
    anthropic_limit_headers,
    error_body,
    go_duration_seconds,
    rfc3339_after,
)
from conduit_gateway.parsers.chat_output import ChatOutputParser
from conduit_gateway.parsers.reasoning import reasoning_parser_class
from conduit_gateway.parsers.tool_calls import tool_call_parser_class
from tests.gateway.anthropic_events import parse_events, reassemble
from tests.gateway.parsed_output import every_split

pytestmark = pytest.mark.unit

OUTPUT = (
    'I should look.</think>Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _blocks(pieces: list[str], thinking: bool = True) -> tuple[list[dict], str]:
    output = ChatOutputParser(reasoning_parser_class("deepseek_r1")(), tool_call_parser_class("hermes")())
    blocks = MessageBlocks(thinking)
    events = []
    for piece in pieces:
        events += blocks.add(output.feed(piece))
    events += blocks.add(output.finish())
    events += blocks.close()
    return blocks.blocks, "".join(sse(name, data) for name, data in events)


def _without_ids(blocks: list[dict]) -> list[dict]:
    return [{**block, "id": None} if "id" in block else block for block in blocks]


def test_blocks_follow_the_output_whatever_its_split():
    whole, _ = _blocks([OUTPUT])
    assert _without_ids(whole) == [
        {"type": "thinking", "thinking": "I should look.", "signature": whole[0]["signature"]},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": None, "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": None, "name": "get_time", "input": {}},
    ]
    assert whole[2]["id"].startswith("toolu_") and whole[2]["id"] != whole[3]["id"]
    for pieces in every_split(OUTPUT):
        blocks, body = _blocks(pieces)
        assert _without_ids(blocks) == _without_ids(whole), pieces
        assert _without_ids(reassemble(parse_events(_framed(body)))["content"]) == _without_ids(whole)


def _framed(body: str) -> str:
    """Content block events between the message's opening and closing events."""
    opening = {"content": [], "stop_reason": None, "usage": {}}
    delta = {"delta": {"stop_reason": "tool_use"}, "usage": {}}
    return (
        sse("message_start", {"type": "message_start", "message": opening})
        + body
        + sse("message_delta", {"type": "message_delta", **delta})
        + sse("message_stop", {"type": "message_stop"})
    )


def test_thinking_off_drops_the_reasoning_and_omitted_keeps_the_block():
    blocks, _ = _blocks([OUTPUT], thinking=False)
    assert [block["type"] for block in blocks] == ["text", "tool_use", "tool_use"]
    omitted = MessageBlocks(thinking=True, omit_thinking=True)
    omitted.add(ChatOutputParser(reasoning_parser_class("deepseek_r1")()).feed("hmm</think>ok"))
    omitted.close()
    assert omitted.blocks[0] == {
        "type": "thinking",
        "thinking": "",
        "signature": omitted.blocks[0]["signature"],
    }


def test_a_call_cut_short_has_an_empty_input():
    blocks, _ = _blocks(['</think><tool_call>{"name": "get_weather", "arguments": {"city": "Os'])
    assert blocks[-1]["input"] == {}


def test_go_durations_and_reset_times():
    assert [go_duration_seconds(text) for text in ("0s", "17ms", "8.64s", "6m0s", "1h0m0s")] == [
        0.0,
        0.017,
        8.64,
        360.0,
        3600.0,
    ]
    assert go_duration_seconds("soon") is None and go_duration_seconds("5s later") is None
    noon = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
    assert rfc3339_after(0.2, noon) == "2026-12-02T12:00:01Z"
    headers = MutableHeaders(
        {
            "x-ratelimit-limit-requests": "2",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "1m0s",
        }
    )
    anthropic_limit_headers(headers)
    assert headers["anthropic-ratelimit-requests-limit"] == "2"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert "anthropic-ratelimit-tokens-limit" not in headers


@pytest.mark.parametrize(
    ("status", "kind", "sent"),
    [(400, "invalid_request_error", 400), (401, "authentication_error", 401), (403, "permission_error", 403),
     (404, "not_found_error", 404), (408, "invalid_request_error", 408), (413, "request_too_large", 413),
     (429, "rate_limit_error", 429), (500, "api_error", 500), (503, "overloaded_error", 529),
     (504, "timeout_error", 504)],
)  # fmt: skip
def test_error_types_by_status(status, kind, sent):
    assert error_body(status, "m", "r1") == {
        "type": "error",
        "error": {"type": kind, "message": "m"},
        "request_id": "r1",
    }


# -- the thinking budget ---------------------------------------------------------------------------


class ScriptedStream:
    """An EngineStream over fixed messages."""

    def __init__(self, messages: list[engine_pb2.GenerateResponse]) -> None:
        self.prompt_index = 0
        self.first, self._rest = messages[0], list(messages[1:])
        self.closed = False

    async def read(self) -> engine_pb2.GenerateResponse | None:
        return self._rest.pop(0) if self._rest else None

    def close(self) -> None:
        self.closed = True


def _message(text: str, ids: list[int], completion: int, finish: int = 0, stop: str | None = None):
    message = engine_pb2.GenerateResponse(
        text=text,
        token_ids=ids,
        usage=engine_pb2.Usage(prompt_tokens=5, cached_tokens=2, completion_tokens=completion),
        finished=finish != 0,
        finish_reason=finish,
    )
    if stop is not None:
        message.stop_string = stop
    return message


def _run(reasoning: list, answer: list, budget: int = 3, max_tokens: int = 10):
    answer_request = engine_pb2.GenerateRequest(request_id="r", chat=engine_pb2.ChatInput())
    answer_request.sampling.max_tokens = max_tokens
    answer_request.sampling.json_schema = "{}"
    first = ScriptedStream(reasoning)
    first.first.prompt_token_ids.extend([1, 2, 3, 4, 5])
    opened: list[engine_pb2.GenerateRequest] = []

    async def open_continuation(request):
        opened.append(request)
        return ScriptedStream(answer)

    async def end_tag_ids():
        return [99]

    async def read_all():
        stream = BudgetedStream(
            first, answer_request, ThinkingBudget(budget, "</think>"), open_continuation, end_tag_ids
        )
        out = [stream.first]
        while (message := await stream.read()) is not None:
            out.append(message)
        return out

    return asyncio.run(read_all()), opened, first


def test_reasoning_past_its_budget_is_closed_by_the_gateway():
    length = engine_pb2.FINISH_REASON_LENGTH
    reasoning = [_message("a", [11], 1), _message("bc", [12, 13], 3, finish=length)]
    answer = [_message("{}", [20], 1, finish=engine_pb2.FINISH_REASON_STOP)]
    out, (continuation,), first = _run(reasoning, answer)
    assert first.closed
    assert list(continuation.token_ids.ids) == [1, 2, 3, 4, 5, 11, 12, 13, 99]
    assert continuation.sampling.max_tokens == 10 - 3 - 1 and continuation.sampling.json_schema == "{}"
    assert continuation.request_id == "r-answer"
    assert [(m.text, m.finished, m.usage.completion_tokens) for m in out] == [
        ("a", False, 1),
        ("bc", False, 3),
        ("</think>", False, 4),
        ("{}", True, 5),
    ]
    assert {(m.usage.prompt_tokens, m.usage.cached_tokens) for m in out} == {(5, 2)}


def test_reasoning_that_ends_in_time_is_continued_as_written():
    stop = engine_pb2.FINISH_REASON_STOP
    reasoning = [_message("a</think>", [11, 98], 2, finish=stop, stop="</think>")]
    answer = [_message("x", [20], 1), _message("y", [21], 2, finish=stop)]
    out, (continuation,), _ = _run(reasoning, answer)
    assert list(continuation.token_ids.ids) == [1, 2, 3, 4, 5, 11, 98]
    assert continuation.sampling.max_tokens == 8
    assert [(m.text, m.finished) for m in out] == [("a</think>", False), ("x", False), ("y", True)]
    assert not out[0].HasField("stop_string") and out[-1].usage.completion_tokens == 4


def test_an_end_tag_as_the_budgets_last_token_is_not_written_twice():
    length = engine_pb2.FINISH_REASON_LENGTH
    reasoning = [_message("ab", [11, 12], 2), _message("</think>", [98], 3, finish=length)]
    out, (continuation,), _ = _run(reasoning, [_message("x", [20], 1, finish=engine_pb2.FINISH_REASON_STOP)])
    assert list(continuation.token_ids.ids) == [1, 2, 3, 4, 5, 11, 12, 98]
    assert [m.text for m in out] == ["ab", "</think>", "x"]


def test_reasoning_ended_by_eos_or_a_client_stop_ends_the_request():
    stop = engine_pb2.FINISH_REASON_STOP
    out, opened, _ = _run([_message("a", [11], 1, finish=stop)], [])
    assert opened == [] and out[-1].finished
    out, opened, _ = _run([_message("a STOP", [11, 12], 2, finish=stop, stop="STOP")], [])
    assert opened == [] and out[-1].text == "a " and out[-1].stop_string == "STOP"


def test_reasoning_sampling_is_free_text_to_the_budget_and_end_tag():
    answer = engine_pb2.SamplingParams(max_tokens=50, json_schema="{}", structured_after="</think>")
    answer.stop.append("END")
    part = ThinkingBudget(8, "</think>").reasoning_sampling(answer)
    assert part.max_tokens == 8 and list(part.stop) == ["END", "</think>"] and part.include_stop_str_in_output
    assert part.WhichOneof("structured") is None and not part.HasField("structured_after")
    assert json.loads(answer.json_schema) == {}  # the answer's own set is untouched
