"""Accuracy of int8 weights against float32 on one model, the model run directly (no scheduler): the
perplexity of a text (one prefill over it), greedy continuations of prompts (one decode step per token,
through the paged cache) and the largest logprob difference on the float model's greedy path.
Used by tests/engine/test_quantization.py (which pins the bounds) and bench/quant_accuracy.py."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.base import CausalLM
from conduit_engine.models.loader import load_model
from conduit_engine.models.quantization import plan_quantization
from conduit_engine.ops import AttentionMetadata, get_ops

BLOCK = 16

# Held-out text in the style of TinyStories (written for this test; not from the training set).
HELD_OUT = (
    "Once upon a time, there was a little boy named Tom. Tom had a red kite. He liked to fly his kite in "
    "the park with his mom. One day, the wind was very strong. The kite went up high in the sky. Tom "
    "held the string tight, but the kite flew away. Tom was sad and he cried. His mom gave him a big hug. "
    '"Do not be sad, Tom," she said. "We can make a new kite together." They went home and made a blue '
    "kite with a long tail. The next day, Tom and his mom went back to the park. The new kite flew very "
    "high, and Tom was happy. He said thank you to his mom, and they played until the sun went down."
)


def load(folder: Path, quantization: str, cpu_kernels: str = "torch", lm_head: bool = True) -> CausalLM:
    arch = read_arch_config(folder)
    plan = plan_quantization(folder, quantization, lm_head)
    return load_model(folder, arch, get_ops("cpu", cpu_kernels), torch.float32, "cpu", 512, quantization=plan)


class Sequence:
    """One sequence in its own paged cache, run a chunk of tokens at a time."""

    def __init__(self, model: CausalLM, max_len: int) -> None:
        cfg = model.local_config
        blocks = -(-max_len // BLOCK)
        shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.model = model
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        self.table = torch.arange(blocks, dtype=torch.int32)[None]
        self.length = 0

    @torch.inference_mode()
    def run(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens`; their logprobs [len(tokens), V] (float32)."""
        n, start = len(tokens), self.length
        self.length += n
        positions = torch.arange(start, self.length)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([self.length], dtype=torch.int32),
            block_tables=self.table,
            query_lens_cpu=(n,),
            seq_lens_cpu=(self.length,),
            block_size=BLOCK,
        )
        hidden = self.model(torch.tensor(tokens), positions, self.caches, meta)
        return torch.log_softmax(self.model.compute_logits(hidden), dim=-1)


def perplexity(model: CausalLM, texts: list[list[int]]) -> float:
    """exp of the mean negative logprob of every token of `texts` but each one's first (one prefill each)."""
    nll, count = 0.0, 0
    for tokens in texts:
        logprobs = Sequence(model, len(tokens)).run(tokens[:-1])
        nll -= float(logprobs.gather(1, torch.tensor(tokens[1:])[:, None]).sum())
        count += len(tokens) - 1
    return math.exp(nll / count)


def greedy(model: CausalLM, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    seq = Sequence(model, len(prompt) + new_tokens)
    logprobs = seq.run(prompt)[-1]
    out, steps = [], []
    for _ in range(new_tokens):
        steps.append(logprobs)
        out.append(int(logprobs.argmax()))
        logprobs = seq.run([out[-1]])[-1]
    return out, steps


def forced_logprobs(model: CausalLM, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logprobs [len(continuation), V] of each continuation token's step (teacher-forced)."""
    logprobs = Sequence(model, len(prompt) + len(continuation)).run(prompt + continuation[:-1])
    return logprobs[len(prompt) - 1 :]


@dataclass(frozen=True)
class Accuracy:
    ppl_float: float
    ppl_int8: float
    agreement: float  # share of the first `new_tokens` greedy tokens equal to float32's, over all prompts
    identical_prompts: int
    max_logprob_diff: float  # on float32's greedy path, over every vocabulary entry
    max_chosen_logprob_diff: float  # the same, on the tokens float32 chose

    @property
    def ppl_increase(self) -> float:
        return self.ppl_int8 / self.ppl_float - 1


def compare(
    ref: CausalLM, quant: CausalLM, texts: list[list[int]], prompts: list[list[int]], new_tokens: int = 64
) -> Accuracy:
    agree = total = identical = 0
    max_diff = max_chosen = 0.0
    for prompt in prompts:
        ref_out, _ = greedy(ref, prompt, new_tokens)
        q_out, _ = greedy(quant, prompt, new_tokens)
        # tokens agree up to the first divergence (after it the continuations are different texts)
        same = next((i for i, (a, b) in enumerate(zip(ref_out, q_out, strict=True)) if a != b), new_tokens)
        agree += same
        total += new_tokens
        identical += same == new_tokens
        a = forced_logprobs(ref, prompt, ref_out)
        b = forced_logprobs(quant, prompt, ref_out)
        max_diff = max(max_diff, float((a - b).abs().max()))
        chosen = torch.tensor(ref_out)[:, None]
        max_chosen = max(max_chosen, float((a.gather(1, chosen) - b.gather(1, chosen)).abs().max()))
    return Accuracy(
        ppl_float=perplexity(ref, texts),
        ppl_int8=perplexity(quant, texts),
        agreement=agree / total,
        identical_prompts=identical,
        max_logprob_diff=max_diff,
        max_chosen_logprob_diff=max_chosen,
    )


_ADJECTIVES = ("little", "big", "happy", "sad", "kind")
_NOUNS = ("girl", "dog", "cat", "boy", "bird", "fish", "bear", "frog", "king", "tree")


def story_prompts(tokenizer) -> list[list[int]]:
    """50 prompts: 'Once upon a time, there was a <adjective> <noun>' (the tokenizer adds BOS)."""
    return [
        tokenizer.encode(f"Once upon a time, there was a {adj} {noun}").ids
        for adj in _ADJECTIVES
        for noun in _NOUNS
    ]


# The random test models (byte-level vocabulary): texts and prompts of bytes. 24 passages of 40 tokens
# (within the smallest test context, 48): a random model's near-flat logits move its perplexity by a
# few percent either way on one short text, so its mean over 936 tokens is the figure to compare.
_RANDOM = random.Random(31)
RANDOM_TEXTS = [[1] + [_RANDOM.randrange(3, 259) for _ in range(39)] for _ in range(24)]
RANDOM_PROMPTS = [[1, *range(3 + 7 * i, 13 + 7 * i)] for i in range(5)]
