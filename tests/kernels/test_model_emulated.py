"""The real model code with CudaOps on the emulated kernels: on stories260K greedy decoding gives the known
reference text, and batched + chunked + prefix-reusing steps give the tokens TorchOps gives; tiny random
Gemma 2 (sliding window, soft-capping, GeGLU) and Qwen3 (q/k norms) give TorchOps' tokens past the window.

This runs every kernel of a forward pass (norms, rotary on fused-qkv views, KV writes, prefill and decode
attention, SwiGLU) through the exact wrappers the engine uses on a GPU, on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.loader import load_model
from conduit_engine.ops.base import AttentionMetadata
from conduit_engine.ops.cuda_ops import CudaOps
from conduit_engine.ops.kv_quant import cache_layout
from conduit_engine.ops.torch_ops import TorchOps
from tests.support.shared import require_shared
from tests.support.stories import KNOWN_STORY, KNOWN_STORY_TOKENS, MODEL, PROMPT_IDS

pytestmark = pytest.mark.kernels

BLOCK = 16


@pytest.fixture(scope="module")
def stories() -> Path:
    return require_shared(f"models/{MODEL}")


class TinyRunner:
    """Just enough of a model runner for the test: fixed block tables, one step's metadata per call."""

    def __init__(self, folder: Path, ops, num_seqs: int, kv_cache_dtype: str = "auto") -> None:
        config = read_arch_config(folder)
        self.config = config
        self.model = load_model(folder, config, ops, torch.float32, "cpu", 512)
        dtype, row = cache_layout(kv_cache_dtype, torch.float32, config.head_dim)
        shape = (num_seqs * 512 // BLOCK + 1, BLOCK, config.num_kv_heads, row)
        self.caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(config.num_layers)
        ]
        # sequence i owns blocks 1 + i*32 ... (block 0 stays unused, like a padding entry)
        self.tables = torch.arange(num_seqs * 32, dtype=torch.int32).view(num_seqs, 32) + 1

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int], int]]) -> list[int]:
        """chunks: (sequence, new token ids, tokens already cached) → greedy next token per chunk."""
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for seq, tokens, cached in chunks:
            ids += tokens
            for pos in range(cached, cached + len(tokens)):
                positions.append(pos)
                slots.append(int(self.tables[seq, pos // BLOCK]) * BLOCK + pos % BLOCK)
            q_lens.append(len(tokens))
            seq_lens.append(cached + len(tokens))
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.tables[[c[0] for c in chunks]].contiguous(),
            query_lens_cpu=tuple(q_lens),
            seq_lens_cpu=tuple(seq_lens),
            block_size=BLOCK,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
        last = torch.tensor(starts[1:]) - 1
        return self.model.compute_logits(hidden[last]).argmax(-1).tolist()


@pytest.mark.parametrize(
    "family,extra",
    [
        ("gemma2", dict(sliding_window=8, attn_logit_softcapping=4.0, final_logit_softcapping=6.0)),
        ("qwen3", dict(norm_noise=0.3)),
    ],
)
def test_tiny_random_architectures_match_torch_ops(tmp_path, launcher, family, extra):
    from tests.engine.support.model_factory import make_tiny_model

    folder = make_tiny_model(
        tmp_path / family, family=family, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, **extra
    )
    prompt = [1, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140]

    def run(ops) -> list[int]:
        runner = TinyRunner(folder, ops, 1)
        (nxt,) = runner.step([(0, prompt[:7], 0)])  # a chunk, then the rest over the cached 7
        (nxt,) = runner.step([(0, prompt[7:], 7)])
        tokens = [*prompt, nxt]
        for _ in range(24):
            (nxt,) = runner.step([(0, [tokens[-1]], len(tokens) - 1)])
            tokens.append(nxt)
        return tokens[len(prompt) :]

    assert run(CudaOps(launcher, decode_partition_size=32, decode_threads=32)) == run(TorchOps())
    names = {k.name.split("<")[0] for k in launcher.launches}
    assert ("gelu_tanh_and_mul_kernel" in names) == (family == "gemma2")


def test_greedy_decoding_reproduces_the_reference_text(stories, launcher):
    from tokenizers import Tokenizer

    runner = TinyRunner(stories, CudaOps(launcher, decode_partition_size=32, decode_threads=32), 1)
    tokens = [1]
    for _ in range(KNOWN_STORY_TOKENS):
        (nxt,) = runner.step([(0, [tokens[-1]], len(tokens) - 1)])
        tokens.append(nxt)
    text = Tokenizer.from_file(str(stories / "tokenizer.json")).decode(tokens[1:])
    assert text == KNOWN_STORY + "\n"  # the last token is the newline after the story
    decode_grids = [g for k, g in zip(launcher.launches, launcher.grids, strict=True) if "decode" in k.name]
    assert max(grid[2] for grid in decode_grids) > 1  # contexts past 32 tokens went through split-K


def test_batched_chunked_prefill_with_cached_prefix_matches_torch_ops(stories, launcher):
    """Two sequences: one prefilled in chunks of 5 and 9 (the second chunk over cached tokens) while the
    other decodes; then both decode together. Same greedy tokens as TorchOps, step for step."""
    prompt_a = [*PROMPT_IDS, 30, 41, 300, 17, 260, 41, 89, 350, 12]
    prompt_b = list(PROMPT_IDS)

    def run(ops) -> list[list[int]]:
        runner = TinyRunner(stories, ops, 2)
        out_a, out_b = [], []
        (b1,) = runner.step([(1, prompt_b, 0)])
        out_b.append(b1)
        runner.step([(0, prompt_a[:5], 0), (1, [b1], len(prompt_b))])  # a: first chunk, b: decode
        a1, b2 = runner.step([(0, prompt_a[5:], 5), (1, [b1], len(prompt_b))])  # b re-decodes same slot
        out_a.append(a1)
        out_b.append(b2)
        for _ in range(20):
            a, b = runner.step(
                [
                    (0, [out_a[-1]], len(prompt_a) + len(out_a) - 1),
                    (1, [out_b[-1]], len(prompt_b) + len(out_b) - 1),
                ]
            )
            out_a.append(a)
            out_b.append(b)
        return [out_a, out_b]

    assert run(CudaOps(launcher, decode_partition_size=32, decode_threads=32)) == run(TorchOps())


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_caches_give_the_torch_ops_tokens(stories, launcher, kv_cache_dtype):
    """--kv-cache-dtype int8 / fp8 through every CUDA kernel that touches the cache (quantizing writes,
    prefill over a cached chunk, split-K decode): the greedy tokens of TorchOps on the same format."""
    prompt = [*PROMPT_IDS, 30, 41, 300, 17, 260, 41, 89, 350, 12]

    def run(ops) -> list[int]:
        runner = TinyRunner(stories, ops, 1, kv_cache_dtype)
        runner.step([(0, prompt[:6], 0)])
        (nxt,) = runner.step([(0, prompt[6:], 6)])
        tokens = [*prompt, nxt]
        for _ in range(40):
            (nxt,) = runner.step([(0, [tokens[-1]], len(tokens) - 1)])
            tokens.append(nxt)
        return tokens[len(prompt) :]

    assert run(CudaOps(launcher, decode_partition_size=32, decode_threads=32)) == run(TorchOps())
    names = {k.name.split("<")[0] for k in launcher.launches}
    assert {
        "write_kv_quant_kernel",
        "paged_prefill_attention_kernel",
        "paged_decode_attention_kernel",
    } <= names
