"""Every served architecture and RoPE scaling against transformers, on small random configurations.

For each: exact greedy tokens (batched, prefilled in chunks over small blocks), logprobs within 1e-4, and
the same tokens with prefix caching, chunked prefill and forced preemption all on. Sequences run past
the sliding windows (8 tokens) and past the original context of the scaled RoPEs, so the window and the
per-position frequencies are what is being compared.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import ModelLoadError
from conduit_engine.models.architectures import ARCHITECTURES, read_arch_config
from tests.engine.support.harness import generate, greedy, make_engine, run_to_completion
from tests.engine.support.model_factory import load_hf, make_tiny_model
from tests.engine.test_prefix_preemption_parity import submit

pytestmark = pytest.mark.unit

HEAD16 = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
LONGROPE_FACTORS = {
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0],
}

ARCHS: dict[str, dict] = {
    "qwen3-qk-norm": dict(family="qwen3", norm_noise=0.3, **HEAD16),
    "qwen3-sliding-upper-layers": dict(
        family="qwen3",
        num_layers=3,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        norm_noise=0.3,
        **HEAD16,
    ),
    "phi3-longrope": dict(
        family="phi3",
        pad_token_id=0,
        max_position_embeddings=128,
        original_max_position_embeddings=48,
        rope_scaling={"type": "longrope", **LONGROPE_FACTORS},
        norm_noise=0.2,
        **HEAD16,
    ),
    "phi3-sliding": dict(family="phi3", pad_token_id=0, sliding_window=8, **HEAD16),
    "gemma2": dict(
        family="gemma2",
        num_layers=3,
        sliding_window=8,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
        norm_noise=0.3,
        **HEAD16,
    ),
    "mistral-sliding": dict(family="mistral", sliding_window=8, num_heads=8, num_kv_heads=2),
    "qwen2-sliding": dict(
        family="qwen2", num_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "llama-linear": dict(family="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama-dynamic": dict(
        family="llama", max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    ),
    "llama-yarn": dict(
        family="llama",
        max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "llama-yarn-mscale": dict(
        family="llama",
        max_position_embeddings=256,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ),
}

# Prompts stay within the smallest original context (48): see layers/rotary.py on dynamic and longrope.
PROMPT_LENGTHS = (5, 13, 30)
NEW_TOKENS = 28


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", **ARCHS[request.param])
    return request.param, folder


def prompts_for(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"p{n}": [1] + [rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENGTHS}


@torch.inference_mode()
def hf_greedy_logprobs(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-softmax, decoding one token at a time with transformers' cache."""
    step_input, past, tokens, logprobs = torch.tensor([prompt]), None, [], []
    for _ in range(new_tokens):
        result = model(input_ids=step_input, past_key_values=past, use_cache=True)
        past = result.past_key_values
        logits = result.logits[0, -1].float()
        tokens.append(int(logits.argmax()))
        logprobs.append(torch.log_softmax(logits, dim=-1))
        step_input = torch.tensor([[tokens[-1]]])
    return tokens, logprobs


def check_greedy_and_logprobs(name: str, folder, cpu_kernels: str) -> None:
    """Exact greedy tokens and logprobs within 1e-4 of transformers, on the ops `cpu_kernels` picks."""
    hf = load_hf(folder)
    # Block size 4 divides none of the prompts; a 9-token budget prefills them in chunks.
    engine = make_engine(
        folder, block_size=4, num_blocks=256, max_num_batched_tokens=9, cpu_kernels=cpu_kernels
    )
    assert engine.arch.architecture == json.loads((folder / "config.json").read_text())["architectures"][0]
    prompts = prompts_for(7)
    results = generate(engine, prompts, greedy(NEW_TOKENS, ignore_eos=True, logprobs=3))
    for rid, ids in prompts.items():
        tokens, ref_logprobs = hf_greedy_logprobs(hf, ids, NEW_TOKENS)
        out = results[rid]
        assert out.token_ids == tokens, (name, rid)
        got = [lp for o in out.outputs for lp in o.logprobs]
        assert len(got) == NEW_TOKENS
        for step, (lp, ref) in enumerate(zip(got, ref_logprobs, strict=True)):
            top = torch.topk(ref, 3)
            assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4), (name, rid, step)
            assert lp.top_ids == top.indices.tolist(), (name, rid, step)
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4), (name, rid, step)


# The torch reference ops and the default CPU ops (kernels/cpu when built); tests/kernels runs every
# instruction set of kernels/cpu through the same check.
@pytest.mark.parametrize("cpu_kernels", ["torch", "auto"])
def test_greedy_and_logprobs_match_transformers(arch, cpu_kernels):
    check_greedy_and_logprobs(*arch, cpu_kernels)


def test_prefix_caching_chunked_prefill_and_preemption_match_transformers(arch):
    name, folder = arch
    hf = load_hf(folder)
    # The four requests (up to 14 blocks of 4 each, or 5 with a window on every layer, whose blocks behind
    # it are freed) cannot all run in 14 blocks (8 with the window).
    windowed = read_arch_config(folder).uniform_window is not None
    engine = make_engine(folder, block_size=4, num_blocks=8 if windowed else 14, max_num_batched_tokens=7)
    rng = random.Random(3)
    shared = [1] + [rng.randrange(3, 259) for _ in range(12)]
    prompts = {f"r{i}": shared + [rng.randrange(3, 259) for _ in range(3 + 4 * i)] for i in range(4)}
    seqs = submit(engine, prompts, NEW_TOKENS)
    results = run_to_completion(engine)
    assert sum(s.num_preemptions for s in seqs) >= 1, name
    assert sum(results[(rid, 0)].final.usage.cached_tokens for rid in prompts) > 0, name
    for rid, ids in prompts.items():
        assert results[(rid, 0)].token_ids == hf_greedy_logprobs(hf, ids, NEW_TOKENS)[0], (name, rid)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        make_engine(folder)
    assert "unsupported architecture ['FalconForCausalLM']" in str(err.value)
    assert all(name in str(err.value) for name in ARCHITECTURES)


@pytest.mark.parametrize(
    ("rope_scaling", "message"),
    [
        ({"rope_type": "xpos", "factor": 2.0}, "unsupported rope_scaling type 'xpos'"),
        ({"rope_type": "linear"}, r"rope_scaling \(linear\) has a missing or bad field"),
        ({"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "need head_dim / 2 = 8 entries"),
        (
            {"rope_type": "default", "partial_rotary_factor": 0.5},
            "partial_rotary_factor 0.5 is not supported",
        ),
    ],
)
def test_bad_rope_scaling_is_a_clear_error(tmp_path, rope_scaling, message):
    folder = make_tiny_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = rope_scaling
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        make_engine(folder)


def test_a_sliding_window_frees_blocks_so_a_context_outgrows_the_cache(tmp_path):
    folder = make_tiny_model(tmp_path / "mistral", **ARCHS["mistral-sliding"])
    # 8 blocks of 4 tokens hold 32 tokens; the request needs 80. Every layer has the 8-token window, so
    # blocks behind it go back to the cache: between steps the sequence holds the 3 blocks that cover
    # the next query's window (positions N - 7 .. N).
    engine = make_engine(folder, block_size=4, num_blocks=8, max_num_batched_tokens=8)
    assert engine.max_model_len == 512  # the context is the model's, not the window
    assert engine.block_manager.sliding_window == 8
    prompt = prompts_for(11)["p30"][:20]
    engine.add_request(GenerationRequest("long", greedy(60, ignore_eos=True), token_ids=prompt))
    (seq,) = engine.scheduler.waiting
    tokens, most_used = [], 0
    while engine.has_work():
        tokens += [t for out in engine.step() for t in out.token_ids]
        most_used = max(most_used, engine.block_manager.stats().used)
        engine.check_integrity()
    assert tokens == hf_greedy_logprobs(load_hf(folder), prompt, 60)[0]
    assert most_used == 3 and seq.num_preemptions == 0
    assert engine.block_manager.stats().used == 0


@pytest.mark.parametrize(("name", "window"), [("gemma2", None), ("qwen2-sliding", None), ("phi3-sliding", 8)])
def test_only_a_window_on_every_layer_frees_blocks(tmp_path, name, window):
    folder = make_tiny_model(tmp_path / name, **ARCHS[name])
    engine = make_engine(folder)
    assert None in engine.arch.layer_windows or window is not None
    assert engine.block_manager.sliding_window == window
