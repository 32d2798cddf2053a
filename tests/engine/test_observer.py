"""The engine's step and request records (observer.py) on the real stories260K engine, in process.

Exact counts of known work: tokens, first tokens, inter-token gaps, queue entries, preemptions, and where
aborted requests were. Times are only checked for order (arrival ≤ scheduled ≤ first token ≤ end).
"""

from __future__ import annotations

import pytest

from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.observer import RequestRecord, StepRecord
from conduit_engine.engine.request import GenerationRequest
from tests.engine.support.harness import greedy, make_engine, run_to_completion
from tests.support.stories import PROMPT, PROMPT_IDS

pytestmark = pytest.mark.unit


class Recorder:
    """An EngineObserver keeping every record."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.requests: list[RequestRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def on_request_end(self, record: RequestRecord) -> None:
        self.requests.append(record)


@pytest.fixture(scope="module")
def engine(stories_path):
    return make_engine(stories_path, num_blocks=64, max_decode_steps=1)  # one token per step: exact counts


@pytest.fixture
def recorder(engine):
    recorder = Recorder()
    engine.observers[:] = [recorder]
    yield recorder
    engine.observers.clear()


def _submit(engine, request_id: str, max_tokens: int, **params: object) -> None:
    engine.add_request(
        GenerationRequest(request_id, greedy(max_tokens, ignore_eos=True, **params), text=PROMPT)
    )


def test_five_requests_of_sixteen_tokens(engine, recorder):
    for i in range(5):
        _submit(engine, f"r{i}", 16)
    run_to_completion(engine)
    steps = recorder.steps
    assert sum(s.num_generated_tokens for s in steps) == 80
    assert sum(len(s.first_token_times) for s in steps) == 5
    assert sum(s.num_prompt_tokens for s in steps) == 5 * len(PROMPT_IDS)
    assert sum(count for s in steps for _, count in s.token_gaps) == 5 * 15
    assert sum(len(s.queue_times) for s in steps) == 5
    # All five fit one batch: one prefill step, then fifteen decode steps of five sequences.
    assert [s.phase for s in steps] == ["prefill"] + ["decode"] * 15
    assert [s.num_seqs for s in steps] == [5] * 16
    assert [s.num_tokens for s in steps] == [5 * len(PROMPT_IDS)] + [5] * 15
    assert all(s.started <= s.sampled_at <= s.finished for s in steps)
    assert all(gap > 0 for s in steps for gap, _ in s.token_gaps)

    assert sorted(r.request_id for r in recorder.requests) == [f"r{i}" for i in range(5)]
    for record in recorder.requests:
        assert record.finish_reason is FinishReason.LENGTH
        assert (record.num_prompt_tokens, record.num_generated_tokens) == (len(PROMPT_IDS), 16)
        assert record.stage == "decode"
        assert record.trace_context is None
        assert record.arrival <= record.first_scheduled <= record.first_token <= record.finished


def test_choices_each_have_a_first_token_but_the_request_one_ttft(engine, recorder):
    _submit(engine, "n3", 8, n=3, seed=1)
    run_to_completion(engine)
    steps = recorder.steps
    assert sum(s.num_generated_tokens for s in steps) == 24
    assert sum(len(s.first_token_times) for s in steps) == 1
    # Each choice's first token has no predecessor: 3 × 7 gaps.
    assert sum(count for s in steps for _, count in s.token_gaps) == 21
    (record,) = recorder.requests
    assert record.num_generated_tokens == 24


def test_preemptions_are_counted_per_step_and_per_request(stories_path):
    # 8 blocks of 16 tokens: four sequences growing to 5 + 60 tokens each cannot all stay resident.
    engine = make_engine(stories_path, num_blocks=8, max_decode_steps=1)
    recorder = Recorder()
    engine.observers.append(recorder)
    for i in range(4):
        _submit(engine, f"p{i}", 60)
    run_to_completion(engine)
    preempted = sum(s.num_preemptions for s in recorder.steps)
    assert preempted > 0
    assert preempted == sum(r.num_preemptions for r in recorder.requests)
    assert sum(s.num_generated_tokens for s in recorder.steps) == 240
    # A recompute after preemption is a prefill step, and its tokens are not first tokens again.
    assert sum(len(s.first_token_times) for s in recorder.steps) == 4
    assert sum(len(s.queue_times) for s in recorder.steps) == 4


def test_aborts_record_where_the_request_was(engine, recorder):
    _submit(engine, "queued", 4)
    engine.abort("queued")
    _submit(engine, "decoding", 50)
    engine.step()  # prefill: the first token
    engine.step()
    engine.abort("decoding")
    run_to_completion(engine)
    by_id = {r.request_id: r for r in recorder.requests}
    assert by_id["queued"].finish_reason is FinishReason.ABORT
    assert by_id["queued"].stage == "queued"
    assert by_id["queued"].first_scheduled is None
    assert by_id["decoding"].finish_reason is FinishReason.ABORT
    assert by_id["decoding"].stage == "decode"
    assert by_id["decoding"].num_generated_tokens == 2


def test_without_observers_the_engine_keeps_no_times(engine):
    assert engine.observers == []
    _submit(engine, "quiet", 4)
    state = engine._requests["quiet"]
    run_to_completion(engine)
    assert state.first_scheduled is None and state.first_token is None
    assert state.token_times == {0: 0.0}


def test_step_record_groups_tokens_by_their_previous_token_time():
    record = StepRecord(
        started=1.0, phase="decode", num_seqs=3, num_tokens=3, num_preemptions=0, queue_times=[]
    )
    record.sampled_at = 2.0

    class Req:
        def __init__(self, times):
            self.token_times = times
            self.first_token = 0.5
            self.prompt_token_ids = [1]

    class Seq:
        index = 0

    for previous in (1.5, 1.5, 1.0):
        record.token(Req([previous]), Seq())
    assert sorted(record.token_gaps) == [(0.5, 2), (1.0, 1)]
    assert record.num_generated_tokens == 3
    assert record.first_token_times == []
