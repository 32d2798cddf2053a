"""Tensor parallelism on the CPU (gloo): TP=2 worker processes against the model run whole in process.

On ../shared/models/stories260K (8 heads, 4 KV heads) one workload mixes batching, prefix caching,
chunked prefill and preemption (each proven to have happened): greedy tokens are identical, logprobs
and prompt logprobs within 1e-4, and the tokens equal transformers'. Seeded sampling and a regex
constraint give the same tokens (rank 0 samples from the engine's plan); one worker process with
--worker-process gives the same as in process; KV blocks gathered from the shards are the whole
model's layout. Each worker runs the CPU ops that --cpu-kernels chose (the sharded layers one by one on
the kernels). Random configurations cover 2 KV heads with biases and an odd vocabulary (padded
shards), 1 KV head (replicated on both ranks), Phi-3's fused checkpoint tensors and Gemma 2's tied,
scaled embeddings with soft-capping.
"""

from __future__ import annotations

import logging
import random
import re

import numpy as np
import pytest

from conduit_engine.engine.request import GenerationRequest
from conduit_engine.models.architectures import read_arch_config
from conduit_engine.ops import cpu_kernels as cpu_kernels_module
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from tests.engine.support.harness import generate, greedy, make_engine, run_to_completion
from tests.engine.support.model_factory import greedy_with, load_hf, make_tiny_model

pytestmark = pytest.mark.integration

SCENARIO = dict(block_size=4, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=8)
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def stories_engines(stories_path):
    """{"tp1": in process, "tp2": two worker processes}, both with the scenario's small cache."""
    engines = {"tp1": make_engine(stories_path, **SCENARIO)}
    try:
        engines["tp2"] = make_engine(stories_path, tensor_parallel_size=2, **SCENARIO)
        yield engines
    finally:
        for engine in engines.values():
            engine.shutdown()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def mixed_workload(engine) -> tuple[dict, list]:
    """A cached system prompt, then a batch that shares it, prompts longer than the step budget (16) and
    more KV than the 40 blocks hold; returns the results and the batch's sequences."""
    rng = random.Random(7)
    system = [1] + tokens(rng, 19)  # five blocks of four
    generate(engine, {"first": system + tokens(rng, 3)}, greedy(8, ignore_eos=True))
    prompts = {
        "shared-a": system + tokens(rng, 5),
        "shared-b": system + tokens(rng, 9),
        "long-a": [1] + tokens(rng, 37),
        "long-b": [1] + tokens(rng, 29),
        "short": [1, 5, 6],
    }
    for rid, ids in prompts.items():
        params = greedy(24, ignore_eos=True, logprobs=3, prompt_logprobs=2 if rid == "shared-a" else None)
        engine.add_request(GenerationRequest(rid, params, token_ids=ids))
    seqs = list(engine.scheduler.waiting)
    results = {rid: c for (rid, _), c in run_to_completion(engine).items()}
    return {"prompts": prompts, "results": results}, seqs


def assert_logprobs_close(got, want) -> None:
    """Same tokens and top ids, logprobs within 1e-4, same rank for tokens among the top ones (deep in
    the tail, ranks count near-ties that the all-reduce's rounding may reorder)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.token_id, a.top_ids) == (b.token_id, b.top_ids)
        assert a.rank == b.rank or min(a.rank, b.rank) > len(a.top_ids)
        assert abs(a.logprob - b.logprob) <= LOGPROB_TOLERANCE
        assert np.allclose(a.top_logprobs, b.top_logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


def test_mixed_workload_matches_in_process_and_transformers(stories_engines, stories_path):
    runs = {name: mixed_workload(engine) for name, engine in stories_engines.items()}
    (tp1, tp1_seqs), (tp2, tp2_seqs) = runs["tp1"], runs["tp2"]
    hf = load_hf(stories_path)
    for rid, prompt in tp2["prompts"].items():
        got, want = tp2["results"][rid], tp1["results"][rid]
        assert got.token_ids == want.token_ids == greedy_with(hf, prompt, 24), rid
        assert_logprobs_close(
            [lp for o in got.outputs for lp in o.logprobs], [lp for o in want.outputs for lp in o.logprobs]
        )
    assert_logprobs_close(
        tp2["results"]["shared-a"].outputs[0].prompt_logprobs,
        tp1["results"]["shared-a"].outputs[0].prompt_logprobs,
    )
    assert len(tp2["results"]["shared-a"].outputs[0].prompt_logprobs) == len(tp2["prompts"]["shared-a"]) - 1
    # The hard paths really ran: prefix hits, prompts longer than a step, preemptions.
    for results, seqs in ((tp1, tp1_seqs), (tp2, tp2_seqs)):
        cached = {rid: results["results"][rid].final.usage.cached_tokens for rid in ("shared-a", "shared-b")}
        assert cached == {"shared-a": 0, "shared-b": 20}  # prompt logprobs recompute the prefix
        assert sum(s.num_preemptions for s in seqs) >= 1
    assert stories_engines["tp2"].block_manager.stats().used == 0


def test_seeded_sampling_is_the_same_and_batch_independent(stories_engines):
    def params(seed: int, n: int = 1) -> SamplingParams:
        return SamplingParams(
            max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=seed, n=n, ignore_eos=True
        )

    prompts = {f"s{i}": [1, 403, 407, 261 + i] for i in range(4)}
    batched = {}
    for name, engine in stories_engines.items():
        for i, (rid, ids) in enumerate(prompts.items()):
            engine.add_request(GenerationRequest(rid, params(100 + i, n=2 if i == 0 else 1), token_ids=ids))
        batched[name] = {key: c.token_ids for key, c in run_to_completion(engine).items()}
    assert batched["tp2"] == batched["tp1"]
    assert batched["tp2"][("s0", 0)] != batched["tp2"][("s0", 1)]  # choices draw different streams
    for engine in stories_engines.values():  # both, so that both caches keep the same history
        alone = generate(engine, {"s2": prompts["s2"]}, params(102))["s2"].token_ids
        assert alone == batched["tp2"][("s2", 0)]


def test_a_regex_constraint_gives_the_same_text(stories_engines):
    spec = StructuredSpec(StructuredKind.REGEX, text=r"(yes|no), [a-z]+ [a-z]+\.")
    texts = {}
    for name, engine in stories_engines.items():
        params = SamplingParams(max_tokens=24, temperature=0.0, structured=spec)
        texts[name] = generate(engine, {"r": [1, 403, 407]}, params)["r"].text
    assert texts["tp2"] == texts["tp1"]
    assert re.fullmatch(r"(yes|no), [a-z]+ [a-z]+\.", texts["tp2"])


def kv_of_a_request(engine, prompt: list[int]) -> bytes:
    """The KV payload of the first three blocks (12 positions) of a fresh request's sequence."""
    engine.add_request(GenerationRequest("kv", greedy(11, ignore_eos=True), token_ids=prompt))
    seq = engine.scheduler.waiting[0]
    engine.step()  # prefills the prompt: blocks allocated
    table = list(seq.block_table[:3])
    run_to_completion(engine)  # the blocks stay in the prefix cache with their KV
    return engine.executor.gather_kv_blocks(table)


def test_kv_blocks_come_back_in_the_whole_models_layout(stories_engines):
    prompt = [1, 403, 407, 261, 378, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    whole = kv_of_a_request(stories_engines["tp1"], prompt)
    sharded = kv_of_a_request(stories_engines["tp2"], prompt)
    # 5 layers x (k, v) x 3 blocks x 4 slots x 4 KV heads x 8 dims, float32
    assert len(whole) == len(sharded) == 5 * 2 * 3 * 4 * 4 * 8 * 4
    assert np.abs(np.frombuffer(sharded, np.float32) - np.frombuffer(whole, np.float32)).max() < 1e-4
    # Writing the whole model's payload into the shards and reading it back is exact, in any order.
    tp2 = stories_engines["tp2"].executor
    ids = [31, 2, 17]
    before = tp2.gather_kv_blocks(ids)
    noise = np.random.default_rng(0).standard_normal(len(whole) // 4).astype(np.float32).tobytes()
    tp2.scatter_kv_blocks(ids, noise)
    assert tp2.gather_kv_blocks(ids) == noise
    assert (
        tp2.gather_kv_blocks(ids[::-1])
        == np.frombuffer(noise, np.float32).reshape(5, 2, 3, -1)[:, :, ::-1].tobytes()
    )
    tp2.scatter_kv_blocks(ids, before)  # as it was
    assert tp2.gather_kv_blocks(ids) == before


def test_one_worker_process_gives_the_in_process_tokens(stories_path):
    engine = make_engine(stories_path, worker_process=True, **SCENARIO)
    try:
        run, _ = mixed_workload(engine)
    finally:
        engine.shutdown()
    reference = make_engine(stories_path, **SCENARIO)
    want, _ = mixed_workload(reference)
    for rid in want["prompts"]:
        assert run["results"][rid].token_ids == want["results"][rid].token_ids, rid
        assert_logprobs_close(
            [lp for o in run["results"][rid].outputs for lp in o.logprobs],
            [lp for o in want["results"][rid].outputs for lp in o.logprobs],
        )


@pytest.mark.parametrize(
    ("placement", "cpu_kernels", "decoder"),
    [
        (dict(tensor_parallel_size=2), "auto", "layer by layer"),
        (dict(worker_process=True), "auto", "one call per step"),
        (dict(tensor_parallel_size=2), "torch", "layer by layer"),
    ],
    ids=["tp2-kernels", "worker-process-kernels", "tp2-torch"],
)
def test_workers_run_the_chosen_cpu_ops(stories_path, caplog, placement, cpu_kernels, decoder):
    """Every worker loads kernels/cpu itself and prepacks its own shards of the weights (4 projections a
    layer and the LM head); sharded, the layers run one by one (the all-reduce sits between them), whole
    in one worker they run as one call; --cpu-kernels torch reaches the workers too."""
    caplog.set_level(logging.INFO, logger="conduit_engine.executor.multiproc")
    make_engine(stories_path, cpu_kernels=cpu_kernels, **placement, **SCENARIO).shutdown()
    if cpu_kernels == "torch":
        ops = "torch ops"
    else:
        prepacked = 4 * read_arch_config(stories_path).num_layers + 1
        ops = f"cpu kernels ({cpu_kernels_module.supported_isas()[0]}), {prepacked} weights prepacked"
    reports = sorted(r.getMessage() for r in caplog.records if " runs on " in r.getMessage())
    ranks = range(placement.get("tensor_parallel_size", 1))
    assert reports == [f"worker rank {rank} runs on {ops}, decoder {decoder}" for rank in ranks]


HEAD16 = dict(hidden_size=64, num_heads=4, head_dim=16)
CONFIGS = {
    # 2 KV heads, biases on q/k/v/o and the MLP, vocabulary 259: the last shard carries padding.
    "llama-2kv-biases": dict(family="llama", num_kv_heads=2, attention_bias=True, mlp_bias=True, **HEAD16),
    # 1 KV head on 2 ranks: replicated.
    "llama-1kv-replicated": dict(family="llama", num_kv_heads=1, **HEAD16),
    "phi3-fused-checkpoint": dict(family="phi3", num_kv_heads=2, pad_token_id=0, **HEAD16),
    "gemma2-tied-softcap": dict(
        family="gemma2",
        num_kv_heads=2,
        num_layers=3,
        sliding_window=8,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
        norm_noise=0.3,
        **HEAD16,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp(request.param) / "model", seed=4, **CONFIGS[request.param]
    )
    return request.param, folder


def test_random_configurations_match_in_process(tiny):
    name, folder = tiny
    rng = random.Random(5)
    prompts = {f"p{n}": [1] + [rng.randrange(3, 259) for _ in range(n)] for n in (4, 13, 30)}
    params = greedy(20, ignore_eos=True, logprobs=2)
    results = {}
    for size in (1, 2):
        engine = make_engine(
            folder, block_size=4, num_blocks=64, max_num_batched_tokens=16, tensor_parallel_size=size
        )
        try:
            results[size] = generate(engine, prompts, params)
        finally:
            engine.shutdown()
    for rid in prompts:
        got, want = results[2][rid], results[1][rid]
        assert got.token_ids == want.token_ids, (name, rid)
        assert_logprobs_close(
            [lp for o in got.outputs for lp in o.logprobs], [lp for o in want.outputs for lp in o.logprobs]
        )
