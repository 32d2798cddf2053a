"""In-process pieces of the Responses API: the event writer's item and event sequence, the input items'
mapping to chat messages, and the memory store's TTL, size bound and event follow."""

from __future__ import annotations

import asyncio

import pytest

from conduit_gateway.errors import OpenAIError
from conduit_gateway.handlers.response_events import ResponseWriter
from conduit_gateway.handlers.response_input import map_input, output_messages
from conduit_gateway.parsers.chat_output import OutputDelta
from conduit_gateway.parsers.tool_calls import ToolCallDelta
from conduit_gateway.responses.store import MemoryResponseStore, StoredResponse
from conduit_gateway.schemas.responses import InputItemParam

pytestmark = pytest.mark.unit


def _response(response_id: str = "resp_1", status: str = "in_progress") -> dict:
    return {"id": response_id, "status": status, "output": []}


def test_merged_joins_each_run_of_one_items_deltas_and_keeps_sequence_numbers_contiguous():
    """What a client that reads slowly gets of one batch: the same events in the same order, each run
    of one item's deltas as one (logprobs one entry per token), numbered on from the batch's first."""
    writer = ResponseWriter(_response())
    opening = writer.opening()
    one = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    batch = writer.feed(OutputDelta(reasoning="h"))
    batch += writer.feed(OutputDelta(reasoning="m"))
    batch += writer.feed(OutputDelta(reasoning=".", content="Hi"), [one])
    batch += writer.feed(OutputDelta(content=" there"), [one, one])
    batch += writer.feed(OutputDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", '{"a"')]))
    batch += writer.feed(OutputDelta(tool_calls=[ToolCallDelta(0, None, None, ":1}")]))
    unmerged = list(batch)
    merged = writer.merged(batch)
    assert [e["type"] for e in merged] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
    ]
    deltas = [e for e in merged if e["type"].endswith(".delta")]
    assert [e["delta"] for e in deltas] == ["hm.", "Hi there", '{"a":1}']
    assert deltas[1]["logprobs"] == [one, one, one]
    first = len(opening)
    assert [e["sequence_number"] for e in merged] == list(range(first, first + len(merged)))
    # The events it took in are left as they were (a stored copy may hold them).
    assert [e["delta"] for e in unmerged if e["type"] == "response.output_text.delta"] == ["Hi", " there"]
    # The next event goes on from the merged batch's last number.
    final = writer.finish("completed", {"input_tokens": 1})
    assert final[-1]["sequence_number"] == first + len(merged) + len(final) - 1


def test_writer_opens_and_closes_each_item_in_order():
    writer = ResponseWriter(_response())
    events = writer.opening()
    events += writer.feed(OutputDelta(reasoning="hm"))
    events += writer.feed(OutputDelta(reasoning=".", content="Hi"))
    events += writer.feed(OutputDelta(tool_calls=[ToolCallDelta(0, "call_1", "f", '{"a"')]))
    events += writer.feed(OutputDelta(tool_calls=[ToolCallDelta(0, None, None, ":1}")]))
    events += writer.finish("completed", {"input_tokens": 1})
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    output = writer.response["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "hm."}]
    assert output[2]["arguments"] == '{"a":1}' and output[2]["call_id"] == "call_1"
    assert writer.response["output_text"] == "Hi" and all(item["status"] == "completed" for item in output)
    # Events hold snapshots: the added item is still empty although the item grew afterwards.
    assert events[9]["item"]["content"] == []
    assert output_messages(output) == [
        {
            "role": "assistant",
            "content": "Hi",
            "tool_calls": [{"id": "call_1", "name": "f", "arguments": '{"a":1}'}],
        }
    ]


def test_writer_marks_a_cut_or_failed_response():
    writer = ResponseWriter(_response())
    writer.opening()
    writer.feed(OutputDelta(content="Once"))
    (done, part, item, terminal) = writer.finish("incomplete", None, "max_output_tokens")
    assert item["item"]["status"] == "incomplete" and terminal["type"] == "response.incomplete"
    assert terminal["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = ResponseWriter(_response())
    failed.opening()
    (terminal,) = failed.finish("failed", None, error=OpenAIError(500, "boom", code="engine_error"))
    assert terminal["response"]["error"] == {"code": "engine_error", "message": "boom"}
    cancelled = ResponseWriter(_response())
    cancelled.opening()
    assert cancelled.finish("cancelled", None) == []  # no terminal event: the stream just ends


def test_input_items_map_to_chat_messages():
    items = [
        InputItemParam(role="developer", content="Be brief."),
        InputItemParam(
            type="message",
            role="user",
            content=[{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        ),
        InputItemParam(type="reasoning", id="rs_1", summary=[]),
        InputItemParam(type="function_call", call_id="c1", name="f", arguments="{}"),
        InputItemParam(type="function_call", call_id="c2", name="g", arguments="{}"),
        InputItemParam(type="function_call_output", call_id="c1", output="one"),
        InputItemParam(type="function_call_output", call_id="c0", output="earlier"),
    ]
    history = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "name": "h", "arguments": "{}"}]}
    ]
    messages, stored = map_input(items, history)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "name": "f", "arguments": "{}"},
                {"id": "c2", "name": "g", "arguments": "{}"},
            ],
        },
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "earlier", "tool_call_id": "c0"},
    ]
    assert [item["type"] for item in stored] == [
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
    ]
    assert all(item["id"] for item in stored)
    with pytest.raises(OpenAIError) as caught:
        map_input([InputItemParam(type="function_call_output", call_id="c9", output="x")], history)
    assert caught.value.param == "input[0].call_id"


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_memory_store_expires_and_evicts_the_oldest():
    async def scenario() -> None:
        clock = ManualClock()
        records = [
            StoredResponse(
                _response(f"resp_{name}", "completed"), conversation=[{"role": "user", "content": name * 100}]
            )
            for name in "abc"
        ]
        sizes = [len(record.to_json()) for record in records]
        # Room for two records: the third evicts the oldest.
        store = MemoryResponseStore(ttl_s=10, max_bytes=sizes[0] + sizes[1], clock=clock)
        await store.put(records[0])
        clock.now = 5
        await store.put(records[1])
        assert (await store.get("resp_a")).conversation == records[0].conversation
        assert store.bytes_used == sizes[0] + sizes[1]
        clock.now = 8
        await store.put(records[2])
        assert await store.get("resp_a") is None
        assert store.bytes_used == sizes[1] + sizes[2]
        clock.now = 16
        assert await store.get("resp_b") is None  # expired (stored at 5 with a 10 s TTL)
        assert await store.get("resp_c") is not None and not await store.delete("resp_b")
        assert store.bytes_used == sizes[2]

    asyncio.run(scenario())


def test_memory_store_replays_then_follows_until_the_end():
    async def scenario() -> list[int]:
        store = MemoryResponseStore(ttl_s=60, max_bytes=1 << 20)
        record = StoredResponse(_response())
        await store.put(record)
        await store.append_events("resp_1", [{"type": "response.queued", "sequence_number": 0}])
        seen: list[int] = []

        async def follow() -> None:
            async for event in store.follow("resp_1", -1):
                seen.append(event["sequence_number"])

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0)
        await store.append_events("resp_1", [{"type": "response.in_progress", "sequence_number": 1}])
        await store.append_events("resp_1", [{"type": "response.completed", "sequence_number": 2}])
        await asyncio.wait_for(follower, 5)
        return seen

    assert asyncio.run(scenario()) == [0, 1, 2]


def test_store_flags_and_their_environment_variables():
    from conduit_gateway.cli import config_from_args
    from conduit_gateway.config import ConfigError

    config = config_from_args(["--engine", "e:1"], {"CONDUIT_RESPONSE_STORE": "redis://r:6379/1"})
    assert (config.response_store, config.response_store_ttl_s) == ("redis://r:6379/1", 3600.0)
    config = config_from_args(
        ["--engine", "e:1", "--response-store", "none", "--response-store-ttl", "60"], {}
    )
    assert (config.response_store, config.response_store_ttl_s) == ("none", 60.0)
    for argv, message in (
        (["--response-store", "postgres://x"], "response_store: must be memory, none or a redis://"),
        (["--response-store-ttl", "0"], "response_store_ttl: must be > 0"),
        (["--response-store-max-bytes", "0"], "response_store_max_bytes: must be > 0"),
        (["--response-store-password-file", "/p"], "response_store_password_file: needs a Redis"),
    ):
        with pytest.raises(ConfigError, match=message):
            config_from_args(["--engine", "e:1", *argv], {})


def test_reasoning_tokens_of_a_message_that_also_starts_the_answer_are_its_reasoning_share():
    from conduit_gateway.handlers.responses import reasoning_share
    from conduit_gateway.parsers.chat_output import OutputDelta

    assert reasoning_share(OutputDelta(reasoning="abc"), 3) == 3
    assert reasoning_share(OutputDelta(content="abc"), 3) == 0
    # Several tokens in one message, the reasoning's end and the answer's start: a share by characters.
    assert reasoning_share(OutputDelta(reasoning="Hello", content=" Tom went"), 6) == 2
    assert reasoning_share(OutputDelta(reasoning="a", content="b" * 100), 4) == 1
