"""Both sides of a disaggregated request on the real engine core (stories260K, in process, no servers).

A prefill LLMEngine runs requests with `kv_produce`: each choice ends at its first token with the prompt's
KV pinned. A decode LLMEngine admits the same request with `kv_consume`; the test moves the blocks the pull
plan asks for from the source's runner into the destination's (what a transport does), ends the pull
and decodes on. Every result must equal one colocated engine's, token for token and text for text: greedy,
seeded sampling with n = 2, stop strings that start forming at the first token, grammars, logprobs; also
when the pull fails (the prompt is recomputed), with the decode engine's prefix cache already holding
part of the prompt, and when the request is aborted while its pull runs. Each engine ends with no block
held and passes its integrity check.
"""

from __future__ import annotations

import math

import pytest

from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import InvalidRequestError, QueueFullError
from conduit_engine.kv_transfer.errors import KvLayoutMismatchError
from conduit_engine.kv_transfer.params import KvConsume, KvFirstToken, KvHandleRef
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.harness import greedy, make_engine
from tests.engine.support.model_factory import make_tiny_model
from tests.engine.support.pd_harness import (
    assert_same,
    colocated_run,
    consume_request,
    disaggregated,
    produce,
    run,
    transfer_blocks,
)
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.unit


def sampled(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=21, **kw)  # type: ignore[arg-type]


# Lengths around the 16-token block: partial, exactly full, one past, several blocks.
PROMPTS = [list(PROMPT_IDS), [1, *range(300, 315)], [1, *range(320, 336)], [1, *range(40, 90)]]


@pytest.fixture(scope="module")
def colocated(stories_path):
    return make_engine(stories_path)


@pytest.fixture(scope="module")
def prefill(stories_path):
    return make_engine(stories_path, role="prefill")


@pytest.fixture(scope="module")
def decode(stories_path):
    return make_engine(stories_path, role="decode")


@pytest.fixture(autouse=True)
def idle_engines(colocated, prefill, decode):
    """Every test leaves every engine without a block held (pins included)."""
    yield
    for engine in (colocated, prefill, decode):
        engine.check_integrity()
        assert engine.block_manager.stats().used == 0
        assert engine.stats().kv_transfers_pending == 0


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"{len(p)}tok")
def test_greedy_decode_continues_exactly_as_colocated(colocated, prefill, decode, prompt):
    params = greedy(24, ignore_eos=True)
    before = decode.stats()
    assert_same(
        disaggregated(prefill, decode, "g", prompt, params), colocated_run(colocated, "g", prompt, params)
    )
    after = decode.stats()
    blocks = -(-len(prompt) // 16)
    assert after.kv_bytes_pulled - before.kv_bytes_pulled == blocks * decode.kv_layout.block_bytes


def test_seeded_n2_sampling_gives_the_same_tokens(colocated, prefill, decode):
    params = sampled(20, n=2)
    pd = disaggregated(prefill, decode, "s", PROMPTS[2], params)
    ref = colocated_run(colocated, "s", PROMPTS[2], params)
    assert_same(pd, ref)
    assert pd[0].token_ids != pd[1].token_ids  # the choices' own seeds (seed + index)
    # Usage as the decode engine counts it: both choices, first tokens included.
    assert pd[1].final.usage.completion_tokens == ref[1].final.usage.completion_tokens == 40


def test_a_stop_string_starting_at_the_first_token_is_held_back_across_the_engines(
    colocated, prefill, decode
):
    prompt = list(PROMPT_IDS)  # greedy: ", there was a little girl named Lily"
    for stop in ([", there was"], [", th"], [" Lily"], [", but"]):
        params = greedy(20, stop=stop)
        pd = disaggregated(prefill, decode, "stop", prompt, params)
        assert_same(pd, colocated_run(colocated, "stop", prompt, params))
    # The first token "," could begin ", there was": the prefill engine released no text for it.
    firsts = produce(prefill, "held", prompt, greedy(20, stop=[", there was"]))
    assert (firsts[0].token_ids, firsts[0].text) == ([432], "")
    prefill.kv_registry.release(firsts[0].kv_transfer.transfer_id)


def test_logprobs_of_both_engines_match_colocated(colocated, prefill, decode):
    params = greedy(12, logprobs=3)
    pd = disaggregated(prefill, decode, "lp", PROMPTS[3], params)
    ref = colocated_run(colocated, "lp", PROMPTS[3], params)
    assert_same(pd, ref)
    got = [lp for out in pd[0].outputs for lp in out.logprobs]
    want = [lp for out in ref[0].outputs for lp in out.logprobs]
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want] and len(got) == 12
    for a, b in zip(got, want, strict=True):
        assert a.top_ids == b.top_ids and math.isclose(a.logprob, b.logprob, abs_tol=1e-5)


def test_a_grammar_continues_on_the_decode_engine(colocated, prefill, decode):
    spec = StructuredSpec(StructuredKind.REGEX, text=r"(Once|Then) [a-z]+ [a-z]+\.")
    params = greedy(16, structured=spec)
    pd = disaggregated(prefill, decode, "re", PROMPTS[0], params)
    assert_same(pd, colocated_run(colocated, "re", PROMPTS[0], params))
    assert pd[0].final.finish_reason is FinishReason.STOP


def test_a_failed_pull_is_recomputed_with_identical_tokens(colocated, prefill, decode):
    params = greedy(20, n=2, ignore_eos=True)
    before = decode.stats().kv_bytes_pulled
    pd = disaggregated(prefill, decode, "lost", PROMPTS[3], params, pull=False)
    assert_same(pd, colocated_run(colocated, "lost", PROMPTS[3], params))
    assert decode.stats().kv_bytes_pulled == before


def test_blocks_in_the_decode_prefix_cache_are_not_pulled_and_count_as_saved(prefill, decode):
    decode.block_manager.reset_prefix_cache()
    shared = [1, *range(100, 131)]  # two full blocks
    params = greedy(4, ignore_eos=True)
    disaggregated(prefill, decode, "warm", [*shared, 7, 8], params)
    before = decode.stats()
    disaggregated(prefill, decode, "hit", [*shared, 9, 10, 11], params)
    after = decode.stats()
    block = decode.kv_layout.block_bytes
    assert (after.kv_bytes_pulled - before.kv_bytes_pulled, after.kv_bytes_saved - before.kv_bytes_saved) == (
        block,
        2 * block,
    )


def test_pinned_blocks_stay_until_the_transfer_is_released(prefill):
    firsts = produce(prefill, "pin", PROMPTS[3], greedy(8))
    transfer = firsts[0].kv_transfer
    assert firsts[0].finish_reason is FinishReason.KV_HANDOFF and transfer.num_tokens == len(PROMPTS[3])
    stats = prefill.stats()
    assert (stats.kv_transfers_pending, stats.blocks.pinned, stats.blocks.used) == (1, 4, 4)
    assert prefill.kv_registry.release(transfer.transfer_id)


def test_choices_that_all_stop_at_their_first_token_hand_nothing_off(prefill):
    firsts = produce(prefill, "one", PROMPTS[1], sampled(1, n=2))
    assert {out.finish_reason for out in firsts.values()} == {FinishReason.LENGTH}
    assert all(out.kv_transfer is None for out in firsts.values())


def test_an_abort_while_the_pull_runs_frees_the_blocks_only_when_it_ends(prefill, decode):
    params = greedy(8, n=2)
    firsts = produce(prefill, "ab", PROMPTS[3], params)
    decode.add_request(consume_request("ab", PROMPTS[3], params, firsts, decode.kv_layout))
    outputs = decode.abort("ab")
    assert [(out.index, out.finish_reason) for out in outputs] == [
        (0, FinishReason.ABORT),
        (1, FinishReason.ABORT),
    ]
    decode.check_integrity()
    assert decode.block_manager.stats().used == 4  # the pull may still be writing into them
    transfer_blocks(prefill, decode, "ab")
    decode.finish_pull("ab", None)
    assert decode.block_manager.stats().used == 0 and not decode.has_work()


def test_requests_the_engine_cannot_take_name_their_field(colocated, prefill, decode):
    params = greedy(8)
    firsts = produce(prefill, "bad", PROMPTS[1], params)
    good = consume_request("bad", PROMPTS[1], params, firsts, decode.kv_layout)
    consume, handle = good.kv_consume, good.kv_consume.handle

    def with_consume(**changes) -> GenerationRequest:
        fields = {"handle": handle, "first_tokens": consume.first_tokens} | changes
        return GenerationRequest("bad", params, token_ids=PROMPTS[1], kv_consume=KvConsume(**fields))

    cases = [
        (prefill, good, "kv_transfer.consume: this engine's role is prefill"),
        (decode, GenerationRequest("p", params, token_ids=[1], kv_produce=True), "kv_transfer.produce: "),
        (
            decode,
            with_consume(first_tokens=(KvFirstToken(1, 5),)),
            "first_tokens: choice index 1 is not below n",
        ),
        (
            decode,
            with_consume(first_tokens=(KvFirstToken(0, 600),)),
            "token id 600 is outside the vocabulary",
        ),
        (decode, with_consume(first_tokens=(KvFirstToken(0, 2),)), "token 2 of choice 0 ends the choice"),
        (
            decode,
            GenerationRequest("bad", params, token_ids=PROMPTS[0], kv_consume=consume),
            "handle.num_tokens: the handle holds 16 tokens but the prompt has 5",
        ),
    ]
    for engine, request, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(request)
    other = KvHandleRef(handle.transfer_id, handle.source_address, handle.num_tokens, "f" * 64)
    with pytest.raises(KvLayoutMismatchError, match="layout.fingerprint: f+ differs from this engine's"):
        decode.add_request(with_consume(handle=other))
    structured = greedy(8, structured=StructuredSpec(StructuredKind.CHOICE, choices=("yes", "no")))
    with pytest.raises(InvalidRequestError, match="is not allowed by the request's output structure"):
        decode.add_request(
            GenerationRequest("bad", structured, token_ids=PROMPTS[1], kv_consume=with_consume().kv_consume)
        )
    assert decode.block_manager.stats().used == 0 and not decode.has_request("bad")
    assert prefill.kv_registry.release(handle.transfer_id)


def test_no_room_for_the_pull_is_resource_exhausted(stories_path, prefill):
    small = make_engine(stories_path, num_blocks=6, role="decode")
    busy = [1, *range(200, 250)]  # no block in common with the pulled prompt
    small.add_request(GenerationRequest("busy", greedy(40, ignore_eos=True), token_ids=busy))
    small.step()  # holds 4 blocks of 6
    params = greedy(8)
    firsts = produce(prefill, "full", PROMPTS[3], params)
    with pytest.raises(QueueFullError, match=r"no room for the pulled prompt now \(4 blocks, 2 free\)"):
        small.add_request(consume_request("full", PROMPTS[3], params, firsts, small.kv_layout))
    run(small)
    assert small.block_manager.stats().used == 0
    assert prefill.kv_registry.release(firsts[0].kv_transfer.transfer_id)


def test_sliding_window_models_are_refused_for_disaggregation(tmp_path):
    folder = make_tiny_model(tmp_path / "mistral", "mistral", sliding_window=8)
    engine = make_engine(folder, num_blocks=32, block_size=4)
    with pytest.raises(
        InvalidRequestError, match="kv_transfer.produce: this model attends through a sliding window"
    ):
        engine.add_request(GenerationRequest("w", greedy(4), token_ids=[1, 2, 3], kv_produce=True))
