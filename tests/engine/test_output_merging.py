"""A reader that falls behind the engine gets the outputs waiting for it merged, one per choice, with
nothing lost or reordered (AsyncEngine.generate, RequestOutput.merged_with)."""

from __future__ import annotations

import asyncio

import pytest

from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.async_engine import AsyncEngine, _coalesce
from conduit_engine.engine.request import GenerationRequest, RequestOutput, Usage
from conduit_engine.sampling.token_logprobs import TokenLogprobs
from tests.engine.support.harness import generate, greedy, make_engine

pytestmark = pytest.mark.unit


def _output(index: int, token: int, *, finished: bool = False, first: bool = False) -> RequestOutput:
    logprob = TokenLogprobs(token, -0.5, 1, [token], [-0.5])
    return RequestOutput(
        request_id="r",
        index=index,
        text=f"<{token}>",
        token_ids=[token],
        usage=Usage(prompt_tokens=3, completion_tokens=token, cached_tokens=0),
        logprobs=[logprob],
        finished=finished,
        finish_reason=FinishReason.LENGTH if finished else None,
        prompt_token_ids=[1, 2, 3] if first else None,
    )


def test_merged_output_keeps_every_token_and_the_latest_state():
    merged = _output(0, 1, first=True).merged_with(_output(0, 2)).merged_with(_output(0, 3, finished=True))
    assert merged.token_ids == [1, 2, 3] and merged.text == "<1><2><3>"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3]
    assert merged.usage.completion_tokens == 3  # running usage: the latest
    assert merged.finished and merged.finish_reason is FinishReason.LENGTH
    assert merged.prompt_token_ids == [1, 2, 3]  # only the request's first output carries them


async def test_waiting_outputs_merge_per_choice_in_order():
    waiting: asyncio.Queue = asyncio.Queue()
    for item in (_output(1, 10), _output(0, 2), _output(1, 11, finished=True), _output(0, 3)):
        waiting.put_nowait(item)
    merged = _coalesce(_output(0, 1, first=True), waiting)
    assert [(m.index, m.token_ids, m.finished) for m in merged] == [
        (0, [1, 2, 3], False),
        (1, [10, 11], True),
    ]
    assert waiting.empty()
    error = RuntimeError("engine gone")
    waiting.put_nowait(error)
    waiting.put_nowait(_output(0, 4))
    assert _coalesce(_output(0, 3), waiting) == [_output(0, 3), error]  # the rest stays queued
    assert waiting.qsize() == 1


async def test_an_output_reporting_an_error_is_never_merged():
    failed = _output(0, 3, finished=True)
    failed.error = "the engine step failed: RuntimeError"
    waiting: asyncio.Queue = asyncio.Queue()
    for item in (_output(0, 2), failed):
        waiting.put_nowait(item)
    merged = _coalesce(_output(0, 1, first=True), waiting)
    assert [(m.token_ids, m.error) for m in merged] == [([1, 2], None), ([3], failed.error)]


async def test_a_reader_behind_the_engine_gets_one_merged_output(stories_path):
    engine = AsyncEngine(make_engine(stories_path))
    try:
        tokens = 24
        request = GenerationRequest("late", greedy(tokens, ignore_eos=True), token_ids=[1, 403, 407])
        expected = generate(make_engine(stories_path), {"x": [1, 403, 407]}, greedy(tokens, ignore_eos=True))[
            "x"
        ]
        reader = engine.generate(request)
        first = await reader.__anext__()  # submitted; now fall behind until the engine is done
        while await engine.run_sync(lambda: engine.core.has_request("late")):
            await asyncio.sleep(0.01)
        outputs = [first, *[out async for out in reader]]
        # Everything after the first read arrives as one output (the first may already hold them all).
        assert len(outputs) <= 2 and outputs[-1].finished
        assert [t for out in outputs for t in out.token_ids] == expected.token_ids
        assert "".join(out.text for out in outputs) == expected.text
        assert outputs[-1].usage.completion_tokens == tokens
    finally:
        engine.shutdown()
