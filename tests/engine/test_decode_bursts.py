"""Decode bursts (decode_bursts.py): several forward passes per step of pure decodes.

A burst must be invisible in what a client gets: the same tokens, text, finish reason and usage as one
pass per step, whatever stops a choice inside a burst, and every KV block back afterwards. Bursts are
forced here (a time budget no pass reaches), and each test checks that they really ran.
"""

from __future__ import annotations

import pytest

from conduit_engine.config import SchedulerConfig
from conduit_engine.core.block_manager import BlockManager
from conduit_engine.core.decode_bursts import DecodeBursts
from conduit_engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from conduit_engine.core.sequence import Sequence, SequenceStatus
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams
from tests.engine.support.harness import Collected, greedy, make_engine, run_to_completion

pytestmark = pytest.mark.unit

FORCED = {"max_decode_steps": 8, "decode_burst_ms": 1e6}  # every allowed step bursts, 8 passes
ONE_PASS = {"max_decode_steps": 1}

PROMPTS = {
    "a": [1, 320, 1500, 2000, 17],
    "b": [1, 9038, 2501, 263, 931, 29892, 727, 471],
    "c": [1, 450, 4799, 338],
}


def run(model, requests: dict[str, tuple[list[int], SamplingParams]], **engine_kw):
    engine = make_engine(model, **engine_kw)
    for rid, (ids, params) in requests.items():
        engine.add_request(GenerationRequest(rid, params, token_ids=ids))
    results = run_to_completion(engine)  # asserts integrity and that every block came back
    return engine, {rid: c for (rid, _), c in results.items()}


def client_view(collected: Collected) -> tuple:
    final = collected.final
    return (
        collected.token_ids,
        collected.text,
        final.finish_reason,
        final.stop_string,
        final.stop_token_id,
        final.usage.completion_tokens,
    )


def assert_same_as_one_pass(model, requests, **engine_kw) -> dict[str, Collected]:
    """Run `requests` with forced bursts and with one pass per step; the client sees the same."""
    one_engine, one = run(model, requests, **ONE_PASS, **engine_kw)
    burst_engine, burst = run(model, requests, **FORCED, **engine_kw)
    assert one_engine.scheduler.bursts.num_bursts == 0
    assert burst_engine.scheduler.bursts.num_bursts > 0, "no burst ran: the test proved nothing"
    assert {rid: client_view(c) for rid, c in burst.items()} == {
        rid: client_view(c) for rid, c in one.items()
    }
    return one


def in_vocab(prompts: dict[str, list[int]], vocab: int) -> dict[str, list[int]]:
    """The prompts with every token id taken modulo the vocabulary size."""
    return {rid: [t % vocab for t in ids] for rid, ids in prompts.items()}


def test_bursts_give_the_same_tokens_text_and_usage(stories_path):
    prompts = in_vocab(PROMPTS, 512)
    requests = {
        "a": (prompts["a"], greedy(37, ignore_eos=True)),
        "b": (prompts["b"], greedy(64, ignore_eos=True)),
        "c": (prompts["c"], greedy(5)),
        "d": (prompts["a"], greedy(50)),  # may stop at EOS inside a burst
    }
    one = assert_same_as_one_pass(stories_path, requests)
    assert len(one["a"].token_ids) == 37 and len(one["b"].token_ids) == 64


def test_a_stop_inside_a_burst_drops_the_tokens_after_it(stories_path):
    prompt = in_vocab(PROMPTS, 512)["b"]
    _, reference = run(stories_path, {"r": (prompt, greedy(60, ignore_eos=True))}, **ONE_PASS)
    tokens, text = reference["r"].token_ids, reference["r"].text
    stop_string = text[len(text) // 2 : len(text) // 2 + 3]
    stop_token = tokens[13]
    requests = {
        "string": (prompt, greedy(60, ignore_eos=True, stop=[stop_string])),
        "string-kept": (
            prompt,
            greedy(60, ignore_eos=True, stop=[stop_string], include_stop_str_in_output=True),
        ),
        "token": (prompt, greedy(60, ignore_eos=True, stop_token_ids=[stop_token])),
        "length": (prompt, greedy(11, ignore_eos=True)),
        "min-tokens": (prompt, greedy(60, ignore_eos=True, stop_token_ids=[tokens[1]], min_tokens=4)),
    }
    one = assert_same_as_one_pass(stories_path, requests)
    assert one["string"].final.stop_string == stop_string
    assert one["token"].final.stop_token_id == stop_token
    assert len(one["token"].token_ids) <= 14
    assert len(one["length"].token_ids) == 11


def test_blocks_of_dropped_tokens_never_reach_the_prefix_cache(stories_path):
    """A choice stopped inside a burst wrote KV for tokens that were dropped. A later prompt that
    continues the kept text must not be served that KV from the cache: its output matches one pass."""
    prompt = in_vocab(PROMPTS, 512)["a"] * 3  # 15 tokens: the burst crosses block boundaries (size 4)
    _, reference = run(stories_path, {"r": (prompt, greedy(40, ignore_eos=True))}, **ONE_PASS, block_size=4)
    stop_token = reference["r"].token_ids[9]
    first = (prompt, greedy(40, ignore_eos=True, stop_token_ids=[stop_token]))
    for kw in (ONE_PASS, FORCED):
        engine = make_engine(stories_path, block_size=4, **kw)
        engine.add_request(GenerationRequest("first", first[1], token_ids=first[0]))
        kept = run_to_completion(engine)[("first", 0)].token_ids
        follow_up = prompt + kept[:-1] + [5, 6, 7]
        engine.add_request(GenerationRequest("next", greedy(20, ignore_eos=True), token_ids=follow_up))
        collected = run_to_completion(engine)[("next", 0)]
        cached = collected.final.usage.cached_tokens
        if kw is ONE_PASS:
            expected, expected_cached = collected.token_ids, cached
        else:
            assert engine.scheduler.bursts.num_bursts > 0
            assert (collected.token_ids, cached) == (expected, expected_cached)
    assert expected_cached > 0, "the follow-up was not served from the cache: the test proved nothing"


def test_several_choices_and_random_sampling_burst_and_finish(stories_path):
    prompt = in_vocab(PROMPTS, 512)["c"]
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, n=3, ignore_eos=True)
    engine = make_engine(stories_path, **FORCED)
    engine.add_request(GenerationRequest("n", params, token_ids=prompt))
    results = run_to_completion(engine)
    assert engine.scheduler.bursts.num_bursts > 0
    assert sorted(results) == [("n", 0), ("n", 1), ("n", 2)]
    for collected in results.values():
        assert len(collected.token_ids) == 30
        assert all(0 <= t < 512 for t in collected.token_ids)
    # usage counts every choice: the one to finish last reports all tokens
    assert max(c.final.usage.completion_tokens for c in results.values()) == 90


def test_a_burst_step_reports_all_of_its_tokens(stories_path):
    from tests.engine.test_observer import Recorder

    engine = make_engine(stories_path, **FORCED)
    recorder = Recorder()
    engine.observers.append(recorder)
    prompts = in_vocab(PROMPTS, 512)
    for rid in ("a", "b"):
        engine.add_request(GenerationRequest(rid, greedy(30, ignore_eos=True), token_ids=prompts[rid]))
    run_to_completion(engine)
    bursts = [s for s in recorder.steps if s.num_generated_tokens > s.num_seqs]
    assert bursts, "no burst ran"
    assert all(s.phase == "decode" and s.num_tokens == s.num_generated_tokens for s in bursts)
    assert sum(s.num_generated_tokens for s in recorder.steps) == 60
    assert sum(count for s in recorder.steps for _, count in s.token_gaps) == 2 * 29
    assert [r.num_generated_tokens for r in recorder.requests] == [30, 30]


@pytest.mark.parametrize(
    "params",
    [
        greedy(20, ignore_eos=True, logprobs=2),
        greedy(20, ignore_eos=True, presence_penalty=0.5),
        greedy(20, ignore_eos=True, frequency_penalty=0.5),
        greedy(20, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
    ],
    ids=["logprobs", "presence", "frequency", "repetition", "seeded"],
)
def test_sampling_that_reads_the_history_never_bursts(stories_path, params):
    prompts = in_vocab(PROMPTS, 512)
    engine, _ = run(
        stories_path,
        {"special": (prompts["a"], params), "plain": (prompts["b"], greedy(20, ignore_eos=True))},
        **FORCED,
    )
    assert engine.scheduler.bursts.num_bursts == 0


# ----- planning, without a model -------------------------------------------------------------------


def decoding(params: SamplingParams, prompt_len: int = 6, outputs: int = 2) -> Sequence:
    seq = Sequence("r", list(range(1, prompt_len + 1)), params)
    for t in range(outputs):
        seq.append_token(100 + t)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


def step_of(*seqs: Sequence, blocks: BlockManager) -> SchedulerOutput:
    for seq in seqs:
        assert blocks.ensure_slots(seq, seq.num_tokens)
    return SchedulerOutput(scheduled=[ScheduledSeq(seq, 1) for seq in seqs])


def test_the_time_budget_sets_the_passes_after_a_measured_step():
    blocks = BlockManager(64, 4, True)
    bursts = DecodeBursts(blocks, max_decode_steps=8, burst_seconds=0.005, max_model_len=1000)
    out = step_of(decoding(greedy(100)), blocks=blocks)
    assert bursts.plan(out) == 1  # nothing measured yet
    bursts.observe(out, 0.001, 1)  # 1 ms a pass: 5 fit in 5 ms
    assert bursts.plan(out) == 5
    assert len(out.scheduled[0].seq.block_table) == blocks.blocks_needed(
        out.scheduled[0].seq.num_computed_tokens + 5
    )
    prefill = SchedulerOutput(scheduled=[ScheduledSeq(decoding(greedy(100)), 4)])
    bursts.observe(prefill, 1.0, 1)  # a prefill step says nothing of a decode pass
    assert bursts.plan(step_of(decoding(greedy(100)), blocks=blocks)) == 5
    bursts.observe(out, 0.0035, 1)  # a slower pass moves the average to 1.5 ms: 3 fit
    assert bursts.plan(step_of(decoding(greedy(100)), blocks=blocks)) == 3


def test_passes_stop_at_max_tokens_and_the_context_length():
    blocks = BlockManager(64, 4, True)
    bursts = DecodeBursts(blocks, max_decode_steps=8, burst_seconds=1.0, max_model_len=12)
    first = step_of(decoding(greedy(100)), blocks=blocks)
    bursts.observe(first, 0.001, 1)
    assert bursts.plan(step_of(decoding(greedy(5), outputs=2), blocks=blocks)) == 3  # 3 tokens left
    assert bursts.plan(step_of(decoding(greedy(3), outputs=2), blocks=blocks)) == 1  # 1 left
    assert bursts.plan(step_of(decoding(greedy(100), prompt_len=6, outputs=3), blocks=blocks)) == 3  # 9 of 12


def test_a_burst_takes_only_free_blocks_and_changes_nothing_otherwise():
    blocks = BlockManager(5, 4, True)
    bursts = DecodeBursts(blocks, max_decode_steps=8, burst_seconds=1.0, max_model_len=1000)
    seqs = [decoding(greedy(100), prompt_len=2, outputs=1), decoding(greedy(100), prompt_len=2, outputs=1)]
    out = step_of(*seqs, blocks=blocks)  # one block each, 3 free; 8 passes need 2 more each
    bursts.observe(out, 0.001, 1)
    tables = [list(s.block_table) for s in seqs]
    assert bursts.plan(out) == 1
    assert [s.block_table for s in seqs] == tables and blocks.num_free_blocks == 3
    assert bursts.num_bursts == 0


def test_steps_with_a_prefill_or_a_preemption_never_burst():
    blocks = BlockManager(64, 4, True)
    bursts = DecodeBursts(blocks, max_decode_steps=8, burst_seconds=1.0, max_model_len=1000)
    decode = decoding(greedy(100))
    out = step_of(decode, blocks=blocks)
    bursts.observe(out, 0.001, 1)
    prefill = Sequence("p", [1, 2, 3, 4], greedy(100))
    assert blocks.ensure_slots(prefill, 4)
    assert bursts.plan(SchedulerOutput(scheduled=[ScheduledSeq(decode, 1), ScheduledSeq(prefill, 4)])) == 1
    first_token = decoding(greedy(100), outputs=0)  # the prompt's last token: its first output comes now
    assert bursts.plan(step_of(first_token, blocks=blocks)) == 1
    preempting = step_of(decoding(greedy(100)), blocks=blocks)
    preempting.preempted.append(decoding(greedy(100)))
    assert bursts.plan(preempting) == 1


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("max_decode_steps", 0, "--max-decode-steps"), ("decode_burst_ms", 0.0, "--decode-burst-ms")],
)
def test_bad_burst_settings_name_their_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        SchedulerConfig(**{field: value})


def test_a_step_that_verifies_a_proposal_never_bursts():
    blocks = BlockManager(64, 4, True)
    bursts = DecodeBursts(blocks, max_decode_steps=8, burst_seconds=1.0, max_model_len=1000)
    a, b = decoding(greedy(100)), decoding(greedy(100))
    bursts.observe(step_of(a, blocks=blocks), 0.001, 1)
    for proposal in ({"spec_token_ids": (5, 6)}, {"num_draft_tokens": 3}):  # n-gram, draft model
        out = step_of(a, b, blocks=blocks)
        out.scheduled[1] = ScheduledSeq(b, 1, **proposal)
        assert bursts.plan(out) == 1
        bursts.observe(out, 1.0, 1)  # nor does its duration count as a pass's
    assert bursts.plan(step_of(a, b, blocks=blocks)) == 8
