"""LoRA adapters against transformers + PEFT with the adapter merged, on the small random configurations.

For every architecture family: exact greedy tokens and logprobs within 1e-4, for each adapter alone and in
one batch mixing two adapters (different ranks, one rsLoRA) with the base model, on the torch reference
ops and the CPU kernels; the same tokens with prefix caching, chunked prefill and forced preemption.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from conduit_engine.config import LoraConfig
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import FailedPreconditionError, InvalidRequestError, ModelLoadError
from conduit_engine.models.architectures import read_arch_config
from tests.engine.support.harness import greedy, make_engine, run_to_completion
from tests.engine.support.lora_factory import load_merged, make_adapter
from tests.engine.support.model_factory import load_hf, make_tiny_model
from tests.engine.test_architectures import ARCHS, hf_greedy_logprobs

pytestmark = pytest.mark.unit

PARITY_ARCHS = ("llama-linear", "mistral-sliding", "qwen2-sliding", "qwen3-qk-norm", "phi3-sliding", "gemma2")
NEW_TOKENS = 16
PHI3_FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="module", params=PARITY_ARCHS)
def family(request, tmp_path_factory):
    """(name, model folder, {adapter: folder}, {None or adapter: reference model})."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model(root / "model", **ARCHS[request.param])
    fused = ARCHS[request.param]["family"] == "phi3"
    adapters = {
        # rank 8 on every projection (Phi-3: its fused ones, as PEFT names them there)
        "a1": make_adapter(model, root / "a1", r=8, alpha=16, seed=1, targets=PHI3_FUSED if fused else None),
        # rank 4 rsLoRA on attention only
        "a2": make_adapter(
            model,
            root / "a2",
            r=4,
            alpha=8,
            use_rslora=True,
            seed=2,
            targets=["qkv_proj", "o_proj"] if fused else ["q_proj", "v_proj", "o_proj"],
        ),
    }
    refs = {None: load_hf(model), **{name: load_merged(model, path) for name, path in adapters.items()}}
    return request.param, model, adapters, refs


def lora_engine(model, adapters, **kw):
    config = LoraConfig(
        enable_lora=True,
        lora_modules=tuple((name, str(path)) for name, path in adapters.items()),
        max_loras=kw.pop("max_loras", 2),
        max_cpu_loras=kw.pop("max_cpu_loras", None),
        max_lora_rank=kw.pop("max_lora_rank", 8),
    )
    return make_engine(model, lora=config, **kw)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 259) for _ in range(5 + 7 * i)] for i in range(count)]


def check_parity(name, refs, jobs, results) -> None:
    """jobs: request id → (adapter or None, prompt): tokens exact, chosen and top-3 logprobs within 1e-4."""
    for rid, (adapter, prompt) in jobs.items():
        tokens, ref_logprobs = hf_greedy_logprobs(refs[adapter], prompt, NEW_TOKENS)
        out = results[(rid, 0)]
        assert out.token_ids == tokens, (name, rid, adapter)
        got = [lp for o in out.outputs for lp in o.logprobs]
        for step, (lp, ref) in enumerate(zip(got, ref_logprobs, strict=True)):
            top = torch.topk(ref, 3)
            assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4), (name, rid, step)
            assert lp.top_ids == top.indices.tolist(), (name, rid, step)
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4), (name, rid, step)


def submit(engine, jobs, logprobs: int | None = 3) -> None:
    for rid, (adapter, prompt) in jobs.items():
        params = greedy(NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
        engine.add_request(GenerationRequest(rid, params, token_ids=prompt, lora=adapter))


@pytest.mark.parametrize("cpu_kernels", ["torch", "auto"])
def test_each_adapter_alone_matches_peft_merged(family, cpu_kernels):
    name, model, adapters, refs = family
    engine = lora_engine(model, adapters, block_size=4, max_num_batched_tokens=9, cpu_kernels=cpu_kernels)
    for adapter in adapters:
        jobs = {f"{adapter}-{i}": (adapter, p) for i, p in enumerate(prompts(5, 2))}
        submit(engine, jobs)
        check_parity(name, refs, jobs, run_to_completion(engine))


@pytest.mark.parametrize("cpu_kernels", ["torch", "auto"])
def test_one_batch_mixing_two_adapters_and_the_base_model_matches(family, cpu_kernels):
    name, model, adapters, refs = family
    engine = lora_engine(model, adapters, block_size=4, max_num_batched_tokens=64, cpu_kernels=cpu_kernels)
    jobs = {}
    for i, prompt in enumerate(prompts(9, 3)):
        for adapter in (None, "a1", "a2"):
            jobs[f"{adapter}-{i}"] = (adapter, prompt)  # the same prompt under each: rows differ by adapter
    submit(engine, jobs)
    steps = record_adapters(engine)
    check_parity(name, refs, jobs, run_to_completion(engine))
    # The first step ran every prompt: its rows mixed both adapters and the base model.
    assert steps[0] == {None, "a1", "a2"}


def record_adapters(engine) -> list[set]:
    """The set of adapters (None: the base model) of each step's rows, as the executor sees them."""
    steps: list[set] = []
    manager = engine.executor.lora
    batch = manager.batch

    def recording(names, query_lens):
        steps.append(set(names))
        return batch(names, query_lens)

    manager.batch = recording
    return steps


def test_prefix_caching_chunked_prefill_and_preemption_with_adapters(family):
    name, model, adapters, refs = family
    windowed = read_arch_config(model).uniform_window is not None
    engine = lora_engine(
        model, adapters, block_size=4, num_blocks=10 if windowed else 16, max_num_batched_tokens=7
    )
    rng = random.Random(3)
    shared = [1] + [rng.randrange(3, 259) for _ in range(12)]
    jobs = {}
    for i, adapter in enumerate((None, "a1", "a2", "a1")):
        jobs[f"r{i}"] = (adapter, shared + [rng.randrange(3, 259) for _ in range(3 + 4 * i)])
    submit(engine, jobs, logprobs=None)
    seqs = list(engine.scheduler.waiting)
    results = run_to_completion(engine)
    assert sum(s.num_preemptions for s in seqs) >= 1, name
    for rid, (adapter, prompt) in jobs.items():
        assert results[(rid, 0)].token_ids == hf_greedy_logprobs(refs[adapter], prompt, NEW_TOKENS)[0], (
            name,
            rid,
        )
    if not windowed:  # r3 (a1) finds r1's (a1) blocks of the shared prefix
        assert results[("r3", 0)].final.usage.cached_tokens > 0
    engine.check_integrity()


def test_the_prefix_cache_never_serves_one_adapters_kv_to_another(family):
    name, model, adapters, refs = family
    if read_arch_config(model).uniform_window is not None:
        pytest.skip("a window on every layer frees the blocks this test looks for")
    engine = lora_engine(model, adapters, block_size=4)
    prompt = prompts(4, 3)[2]
    cached = {}
    for i, adapter in enumerate(("a1", "a2", None, "a1", "a2")):
        jobs = {f"q{i}": (adapter, prompt)}
        submit(engine, jobs)
        results = run_to_completion(engine)
        check_parity(name, refs, jobs, results)
        cached[i] = results[(f"q{i}", 0)].final.usage.cached_tokens
    # The first run of each (adapter, prompt) computes the prompt; a second run under the same adapter
    # reuses its blocks.
    assert cached[0] == cached[1] == cached[2] == 0
    assert cached[3] > 0 and cached[4] > 0


# ----- loading, refusals, the pool and its slots (llama) --------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-lora")
    model = make_tiny_model(root / "model", **ARCHS["llama-linear"])
    adapters = {f"a{i}": make_adapter(model, root / f"a{i}", r=4, seed=i) for i in range(1, 4)}
    return root, model, adapters


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(use_dora=True), "DoRA (use_dora: true) is not supported"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save (lm_head) is not supported"),
        (dict(targets=["embed_tokens", "q_proj"]), "embedding LoRA (embed_tokens) is not supported"),
        (dict(bias="lora_only"), "bias 'lora_only' is not supported"),
        (dict(r=16), "rank 16 exceeds --max-lora-rank 8"),
    ],
)
def test_unsupported_adapters_are_refused_saying_which_option(llama, options, message):
    root, model, adapters = llama
    options = dict(options)
    r = options.pop("r", 4)
    extra = {k: v for k, v in options.items() if k != "bias"}
    path = make_adapter(model, root / f"bad-{len(message)}", r=r, **extra)
    if "bias" in options:  # PEFT would train a bias: the config says so
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg["bias"] = options["bias"]
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    engine = lora_engine(model, {})
    with pytest.raises(InvalidRequestError) as err:
        engine.load_lora("bad", str(path))
    assert err.value.field == "lora_path"
    assert message in str(err.value)
    assert engine.list_loras() == []


def test_an_adapter_of_another_base_model_is_refused(llama, tmp_path):
    root, model, adapters = llama
    other = make_tiny_model(tmp_path / "other", hidden_size=32, num_heads=2, num_kv_heads=1)
    engine = lora_engine(other, {})
    with pytest.raises(
        InvalidRequestError,
        match="made for another base model: layer 0 mlp.down_proj maps 96 → 64 features, this model.s 96 → 3",
    ):
        engine.load_lora("a1", str(adapters["a1"]))
    with pytest.raises(ModelLoadError, match="--lora-modules a1="):
        lora_engine(other, {"a1": adapters["a1"]})


def test_one_slot_and_one_adapter_in_memory_still_serve_three_adapters(llama):
    """--max-loras 1: the scheduler runs one adapter's requests at a time (beside the base model's);
    --max-cpu-loras 1: the others are read again from their folders when their turn comes."""
    _, model, adapters = llama
    refs = {None: load_hf(model), **{n: load_merged(model, p) for n, p in adapters.items()}}
    engine = lora_engine(model, adapters, max_loras=1, max_cpu_loras=1, max_lora_rank=4)
    assert [a.loaded for a in engine.list_loras()] == [False, False, True]
    jobs = {f"{a}-{i}": (a, p) for i, p in enumerate(prompts(2, 2)) for a in (None, *adapters)}
    steps = record_adapters(engine)
    submit(engine, jobs)
    check_parity("llama", refs, jobs, run_to_completion(engine))
    assert all(len(step - {None}) <= 1 for step in steps)
    assert sum(1 for a in engine.list_loras() if a.loaded) == 1
    # Loading never touched the KV cache: the same tensors as at start.
    assert engine.executor.kv_caches[0][0].data_ptr() == engine.executor.runner.kv_caches[0][0].data_ptr()


def test_unload_waits_for_the_adapters_requests_and_a_reload_computes_afresh(llama):
    _, model, adapters = llama
    engine = lora_engine(model, {"a1": adapters["a1"]}, max_lora_rank=4)
    prompt = prompts(6, 3)[2]
    submit(engine, {"r": ("a1", prompt)})
    with pytest.raises(FailedPreconditionError, match="'a1' has 1 request"):
        engine.unload_lora("a1")
    run_to_completion(engine)
    engine.unload_lora("a1")
    with pytest.raises(InvalidRequestError, match="model: no LoRA adapter 'a1' is loaded"):
        submit(engine, {"s": ("a1", prompt)})
    # Loaded again under the same name (here other weights): its old blocks are never found.
    engine.load_lora("a1", str(adapters["a2"]))
    submit(engine, {"t": ("a1", prompt)})
    results = run_to_completion(engine)
    assert results[("t", 0)].final.usage.cached_tokens == 0
    assert (
        results[("t", 0)].token_ids
        == hf_greedy_logprobs(load_merged(model, adapters["a2"]), prompt, NEW_TOKENS)[0]
    )


def test_lora_modules_flag_parses_name_equals_path():
    from conduit_engine.entrypoints.cli import build_parser, config_from_args

    args = build_parser({}).parse_args(
        ["--model", "m", "--enable-lora", "--lora-modules", "a=/x", "b=org/name", "--max-loras", "2"]
    )
    config = config_from_args(args).lora
    assert config.lora_modules == (("a", "/x"), ("b", "org/name")) and config.max_loras == 2
    assert config.cpu_loras == 2 and config.max_lora_rank == 16
    env = build_parser({"CONDUIT_LORA_MODULES": "a=/x b=/y", "CONDUIT_ENABLE_LORA": "1"}).parse_args(
        ["--model", "m"]
    )
    assert config_from_args(env).lora.lora_modules == (("a", "/x"), ("b", "/y"))
    with pytest.raises(ValueError, match="--lora-modules: expected NAME=PATH, got 'a'"):
        config_from_args(
            build_parser({}).parse_args(["--model", "m", "--enable-lora", "--lora-modules", "a"])
        )


def test_an_adapter_from_a_hub_id_loads_through_the_model_source(llama, tmp_path, monkeypatch):
    """Offline, from a Hub cache laid out as snapshot_download leaves it (tests/support/hub.py)."""
    from huggingface_hub import constants

    from tests.support.hub import lay_out_hub_cache

    _, model, adapters = llama
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "hub"
    lay_out_hub_cache(cache, "conduit-test/lora-a1", adapters["a1"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    engine = lora_engine(model, {}, max_lora_rank=4)
    info = engine.load_lora("hub-a1", "conduit-test/lora-a1")
    assert (info.name, info.path, info.rank) == ("hub-a1", "conduit-test/lora-a1", 4)
    prompt = prompts(8, 2)[1]
    submit(engine, {"h": ("hub-a1", prompt)}, logprobs=None)
    expected = hf_greedy_logprobs(load_merged(model, adapters["a1"]), prompt, NEW_TOKENS)[0]
    assert run_to_completion(engine)[("h", 0)].token_ids == expected
    with pytest.raises(InvalidRequestError, match="'conduit-test/missing' is not in the cache"):
        engine.load_lora("gone", "conduit-test/missing")
