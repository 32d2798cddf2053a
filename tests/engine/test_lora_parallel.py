"""LoRA adapters with the model in worker processes: tensor parallelism (each rank holds its shard of every
adapter, sharded as its base layers are) and --worker-process, against transformers + PEFT merged."""

from __future__ import annotations

import random

import pytest

from conduit_engine.config import LoraConfig
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import InvalidRequestError
from tests.engine.support.harness import greedy, make_engine, run_to_completion
from tests.engine.support.lora_factory import load_merged, make_adapter
from tests.engine.support.model_factory import load_hf, make_tiny_model
from tests.engine.test_architectures import ARCHS, hf_greedy_logprobs

pytestmark = pytest.mark.integration

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tp")
    model = make_tiny_model(root / "model", **ARCHS["llama-linear"])
    adapters = {
        "a1": make_adapter(model, root / "a1", r=8, seed=1),
        "a2": make_adapter(
            model, root / "a2", r=4, seed=2, use_rslora=True, targets=["q_proj", "o_proj", "down_proj"]
        ),
    }
    refs = {None: load_hf(model), **{n: load_merged(model, p) for n, p in adapters.items()}}
    return model, adapters, refs


@pytest.mark.parametrize(("tp", "worker"), [(2, False), (1, True)], ids=["tp2", "worker-process"])
def test_adapters_in_workers_match_peft_merged(setup, tp, worker):
    model, adapters, refs = setup
    lora = LoraConfig(
        enable_lora=True, lora_modules=(("a1", str(adapters["a1"])),), max_loras=2, max_lora_rank=8
    )
    engine = make_engine(
        model,
        tensor_parallel_size=tp,
        worker_process=worker,
        block_size=4,
        max_num_batched_tokens=9,
        lora=lora,
    )
    try:
        engine.load_lora("a2", str(adapters["a2"]))
        rng = random.Random(4)
        jobs = {}
        for i in range(2):
            prompt = [1] + [rng.randrange(3, 259) for _ in range(5 + 9 * i)]
            for adapter in (None, "a1", "a2"):
                jobs[f"{adapter}-{i}"] = (adapter, prompt)
        for rid, (adapter, prompt) in jobs.items():
            engine.add_request(
                GenerationRequest(rid, greedy(NEW_TOKENS, ignore_eos=True), token_ids=prompt, lora=adapter)
            )
        results = run_to_completion(engine)
        for rid, (adapter, prompt) in jobs.items():
            assert results[(rid, 0)].token_ids == hf_greedy_logprobs(refs[adapter], prompt, NEW_TOKENS)[0], (
                rid
            )
        with pytest.raises(InvalidRequestError, match="rank 16 exceeds --max-lora-rank 8"):
            engine.load_lora("big", str(make_adapter(model, model.parent / "big", r=16)))
    finally:
        engine.shutdown()
