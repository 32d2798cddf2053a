"""How close bfloat16 generation on the CPU stays to float32: the check both test layers share."""

from __future__ import annotations

from pathlib import Path

import torch

from conduit_engine.sampling_params import SamplingParams
from tests.engine.support.harness import generate, greedy, make_engine

PROMPTS = {f"p{i}": [1] + list(range(10 + 7 * i, 40 + 7 * i)) for i in range(4)}
NEW_TOKENS = 48
# Measured on stories260K: mean 0.015-0.017 and max 0.12-0.14 nats for every backend (bf16 rounding of
# weights, activations and logits); an error in a kernel's bf16 path is far larger.
MEAN_TOLERANCE = 0.03
MAX_TOLERANCE = 0.25


def check_bf16_logprobs_close_to_f32(model: Path, cpu_kernels: str) -> None:
    """bfloat16 decodes greedily with logprobs; float32 (the torch reference) scores the same tokens
    (teacher-forced, as prompt logprobs), so a divergence cannot compound. The logprobs of the chosen
    tokens must agree within bf16's rounding."""
    bf16 = make_engine(model, dtype="bfloat16", cpu_kernels=cpu_kernels)
    assert bf16.dtype == "bfloat16"
    decoded = generate(bf16, PROMPTS, greedy(NEW_TOKENS, ignore_eos=True, logprobs=0))
    forced = {rid: PROMPTS[rid] + decoded[rid].token_ids for rid in PROMPTS}
    f32 = make_engine(model, dtype="float32", cpu_kernels="torch")
    scored = generate(f32, forced, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    diffs = []
    for rid, prompt in PROMPTS.items():
        ours = [lp.logprob for out in decoded[rid].outputs for lp in out.logprobs]
        reference = [lp.logprob for lp in scored[rid].outputs[0].prompt_logprobs][len(prompt) - 1 :]
        assert len(ours) == len(reference) == NEW_TOKENS
        diffs += [abs(a - b) for a, b in zip(ours, reference, strict=True)]
    errors = torch.tensor(diffs)
    assert errors.mean() <= MEAN_TOLERANCE, f"mean |bf16 - f32| logprob {errors.mean():.4f}"
    assert errors.max() <= MAX_TOLERANCE, f"max |bf16 - f32| logprob {errors.max():.4f}"
