"""Sampling through the whole engine: n > 1 sharing the prompt, batch-independent seeds, logprobs vs
transformers, parameter effects, and invalid values refused over gRPC naming the field."""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.sampling_params import SamplingParams
from tests.engine.support.harness import generate, make_engine, run_to_completion
from tests.engine.support.model_factory import greedy_with, load_hf
from tests.engine.support.server_thread import ServerThread, engine_config
from tests.support.stories import PROMPT, PROMPT_IDS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(stories_path):
    return make_engine(stories_path, block_size=4, num_blocks=512)


def test_n3_shares_prompt_blocks_and_counts_prompt_once(engine):
    prompt = [1] + list(range(10, 30))  # 21 tokens: 5 full blocks of 4 + 1 partial
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3, ignore_eos=True)
    engine.add_request(GenerationRequest("n3", params, token_ids=prompt))
    used = []
    outputs = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.index, []).append(out)
        used.append(engine.block_manager.stats().used)
    engine.check_integrity()
    assert sorted(outputs) == [0, 1, 2]
    # step 1: the first choice prefills (6 blocks); then each sibling adds only its own partial block
    assert used[0] == 6 and used[1] == 6 + 2
    for outs in outputs.values():
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 10
    final = max((o for outs in outputs.values() for o in outs), key=lambda o: o.usage.completion_tokens)
    assert final.usage.prompt_tokens == 21 and final.usage.completion_tokens == 30
    tokens = [[t for o in outputs[i] for t in o.token_ids] for i in range(3)]
    assert len({tuple(t) for t in tokens}) == 3  # each choice has its own seed offset


def test_seeded_request_alone_equals_inside_a_batch(engine):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = generate(engine, {"s": list(PROMPT_IDS[:3])}, params)["s"].token_ids
    rng = random.Random(0)
    for i in range(8):
        other = SamplingParams(
            max_tokens=rng.randrange(5, 30),
            temperature=rng.choice([0.0, 0.7, 1.3]),
            top_k=rng.choice([0, 20]),
        )
        engine.add_request(GenerationRequest(f"o{i}", other, token_ids=[1] + [rng.randrange(3, 512)] * 7))
    engine.add_request(GenerationRequest("s", params, token_ids=list(PROMPT_IDS[:3])))
    batched = run_to_completion(engine)[("s", 0)].token_ids
    assert batched == alone
    again = generate(engine, {"s": list(PROMPT_IDS[:3])}, params)["s"].token_ids
    assert again == alone


def test_unseeded_requests_vary(engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    runs = {tuple(generate(engine, {"u": [1]}, params)["u"].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_logprobs_match_transformers(engine, stories_path):
    prompt = list(PROMPT_IDS)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=3)
    out = generate(engine, {"lp": prompt}, params)["lp"]
    model = load_hf(stories_path)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        ref = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    logprobs = [lp for o in out.outputs for lp in o.logprobs]
    assert len(logprobs) == 6
    for step, lp in enumerate(logprobs):
        row = ref[len(prompt) - 1 + step]
        assert lp.token_id == out.token_ids[step] and lp.rank == 1
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        top = torch.topk(row, 5)
        assert lp.top_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    prompt_lps = out.outputs[0].prompt_logprobs
    assert [p.token_id for p in prompt_lps] == prompt[1:]
    for pos, p in enumerate(prompt_lps):
        assert p.logprob == pytest.approx(float(ref[pos, prompt[pos + 1]]), abs=1e-4)
        assert len(p.top_ids) == 3


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos(engine, stories_path):
    forced = generate(
        engine, {"b": [1]}, SamplingParams(max_tokens=5, temperature=0.0, logit_bias={300: 100.0})
    )
    assert forced["b"].token_ids == [300] * 5
    # stop on the 4th greedy token; min_tokens suppresses it (and EOS) until 10 tokens exist
    natural = generate(engine, {"e": [1]}, SamplingParams(max_tokens=30, temperature=0.0))["e"].token_ids
    stop_id = natural[3]
    stopped = generate(
        engine, {"s": [1]}, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id])
    )
    assert stopped["s"].token_ids == natural[:4]
    held = generate(
        engine,
        {"m": [1]},
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id], min_tokens=10),
    )["m"].token_ids
    assert held[:3] == natural[:3]
    assert len(held) >= 10 and stop_id not in held[:9] and 2 not in held[:9]


def test_penalties_change_greedy_output_as_the_reference_predicts(engine, stories_path):
    base = generate(engine, {"a": [1]}, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))["a"]
    assert base.token_ids == greedy_with(load_hf(stories_path), [1], 40)
    penalized = generate(
        engine,
        {"p": [1]},
        SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=2.0, ignore_eos=True),
    )["p"]
    assert penalized.token_ids != base.token_ids
    # reference: greedy over transformers logits with OpenAI's frequency penalty applied to generated tokens
    model = load_hf(stories_path)
    ids = [1]
    with torch.inference_mode():
        for _ in range(40):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(ids[1:], dtype=torch.long), minlength=logits.numel())
            ids.append(int((logits - 2.0 * counts[: logits.numel()]).argmax()))
    assert penalized.token_ids == ids[1:]


@pytest.fixture(scope="module")
def stub(stories_path):
    srv = ServerThread(engine_config(stories_path)).start()
    yield srv.stub()
    srv.stop()


@pytest.mark.parametrize(
    ("field", "sampling"),
    [
        ("presence_penalty", pb.SamplingParams(presence_penalty=2.5)),
        ("frequency_penalty", pb.SamplingParams(frequency_penalty=-2.5)),
        ("repetition_penalty", pb.SamplingParams(repetition_penalty=0.0)),
        ("logit_bias", pb.SamplingParams(logit_bias={5: 150.0})),
        ("logit_bias", pb.SamplingParams(logit_bias={9999: 1.0})),
        ("stop_token_ids", pb.SamplingParams(stop_token_ids=[9999])),
        ("logprobs", pb.SamplingParams(logprobs=21)),
        ("prompt_logprobs", pb.SamplingParams(prompt_logprobs=25)),
        ("min_p", pb.SamplingParams(min_p=1.5)),
        ("n", pb.SamplingParams(n=0)),
        ("min_tokens", pb.SamplingParams(max_tokens=4, min_tokens=5)),
        ("stop", pb.SamplingParams(stop=[""])),
    ],
)
def test_invalid_sampling_values_name_the_field(stub, field, sampling):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="hi", sampling=sampling)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()


def test_n_streams_over_grpc(stub):
    req = pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingParams(max_tokens=8, n=3, seed=7, ignore_eos=True)
    )
    msgs = list(stub.Generate(req))
    assert sorted({m.index for m in msgs}) == [0, 1, 2]
    finals = [m for m in msgs if m.finished]
    assert sorted(m.index for m in finals) == [0, 1, 2]
    assert msgs[-1].usage.prompt_tokens == 5 and msgs[-1].usage.completion_tokens == 24


def test_prompt_logprobs_once_with_n_and_after_preemption(stories_path):
    prompt = [*PROMPT_IDS, 300, 301]
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, n=3, ignore_eos=True)
    engine = make_engine(stories_path, block_size=4)
    engine.add_request(GenerationRequest("n", params, token_ids=prompt))
    outs = [o for c in run_to_completion(engine).values() for o in c.outputs]
    with_prompt = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1  # sent once, on the request's first output
    assert [p.token_id for p in with_prompt[0].prompt_logprobs] == prompt[1:]
    # a cache so small that the request is preempted in the middle of its prompt
    tiny = make_engine(stories_path, block_size=2, num_blocks=10, max_num_batched_tokens=4)
    long_prompt = [1] + list(range(300, 314))
    tiny.add_request(
        GenerationRequest("big", SamplingParams(max_tokens=12, temperature=0.0), token_ids=[1] * 3)
    )
    tiny.add_request(
        GenerationRequest(
            "lp", SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1), token_ids=long_prompt
        )
    )
    preempted_mid_prompt = []
    real_schedule = tiny.scheduler.schedule

    def record():
        # Computed prompt tokens of "lp" before this step; preemption resets them, so read them first.
        computed = {s.seq_id: s.num_computed_tokens for s in tiny.scheduler.running}
        out = real_schedule()
        for seq in out.preempted:
            if seq.request_id == "lp" and seq.num_output_tokens == 0:
                preempted_mid_prompt.append(computed.get(seq.seq_id, 0))
        return out

    tiny.scheduler.schedule = record
    results = run_to_completion(tiny)
    assert any(n > 0 for n in preempted_mid_prompt)  # the scenario really happened
    lps = results[("lp", 0)].outputs[0].prompt_logprobs
    assert [p.token_id for p in lps] == long_prompt[1:]


def test_stop_strings_wait_for_min_tokens(engine):
    # The greedy story from BOS says "Lily" early; with min_tokens past it, that stop is not taken yet.
    story = generate(engine, {"s": [1]}, SamplingParams(max_tokens=40, temperature=0.0))["s"]
    assert "Lily" in story.text
    early = generate(engine, {"e": [1]}, SamplingParams(max_tokens=40, temperature=0.0, stop=["Lily"]))["e"]
    assert early.text == story.text[: story.text.index("Lily")]
    held = generate(
        engine, {"m": [1]}, SamplingParams(max_tokens=40, temperature=0.0, stop=["Lily"], min_tokens=30)
    )["m"]
    assert held.text.startswith(story.text[: story.text.index("Lily") + 4])
    assert len(held.token_ids) >= 30
