"""Sliding-window and soft-capped attention, and the GeGLU activation, of CudaOps on the emulated kernels
against TorchOps.

Cache blocks that lie wholly below every query's window are pointed at a block full of NaN, as the block
manager frees them: a kernel (or the reference) that reads one, even to mask it, returns NaN.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES
from test_ops_emulated import DTYPE_IDS, REF, TOL, PagedBatch, _check_attention, _ops, _rand, step

from conduit_engine.ops.base import AttentionMetadata

DECODE_CASES = [
    # seq_lens, block_size, heads, kv_heads, head_dim, partition, threads, window, softcap
    ((40, 9, 100), 4, 8, 2, 16, 512, 64, 8, None),  # windows inside long contexts, a context shorter than it
    ((300, 70), 8, 8, 1, 64, 64, 32, 130, None),  # split-K over the window only: 3 partitions, not 5
    ((50, 3), 16, 4, 4, 32, 32, 32, None, 5.0),  # soft-capping alone, split-K
    ((77, 20, 1), 2, 4, 2, 16, 32, 32, 33, 2.5),  # both, split-K, one-token context
    ((64, 65), 16, 4, 4, 8, 512, 32, 1, None),  # window 1: each query sees only itself
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"decode{i}" for i in range(len(DECODE_CASES))])
def test_windowed_soft_capped_decode_matches_reference(launcher, dtype, case):
    seq_lens, block_size, heads, kv_heads, head_dim, partition, threads, window, softcap = case
    _check_attention(
        launcher,
        dtype,
        seq_lens,
        [1] * len(seq_lens),
        block_size,
        heads,
        kv_heads,
        head_dim,
        seed=sum(seq_lens) + block_size,
        sliding_window=window,
        logit_softcap=softcap,
        decode_partition_size=partition,
        decode_threads=threads,
    )
    names = [k.name.split("<")[0] for k in launcher.launches]
    visible = min(max(seq_lens), window or max(seq_lens))
    assert names.count("paged_decode_reduce_kernel") == (1 if visible > partition else 0)


PREFILL_CASES = [
    # seq_lens, query_lens, block_size, heads, kv_heads, head_dim, window, softcap
    ((30,), (30,), 4, 8, 2, 8, 8, None),  # a fresh prompt longer than the window
    ((70, 33), (37, 33), 8, 8, 1, 64, 20, 3.0),  # a chunk after 33 cached tokens, window and soft-capping
    ((50, 5), (17, 1), 16, 4, 1, 128, 16, None),  # a chunk whose window starts mid-block, a decode row
    ((40,), (40,), 4, 4, 4, 8, 1, None),  # window 1
    ((90, 18), (70, 18), 4, 8, 2, 64, None, 1.5),  # soft-capping alone, several key tiles
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"prefill{i}" for i in range(len(PREFILL_CASES))])
def test_windowed_soft_capped_prefill_matches_reference(launcher, dtype, case):
    seq_lens, query_lens, block_size, heads, kv_heads, head_dim, window, softcap = case
    _check_attention(
        launcher,
        dtype,
        seq_lens,
        query_lens,
        block_size,
        heads,
        kv_heads,
        head_dim,
        seed=sum(seq_lens) + head_dim,
        sliding_window=window,
        logit_softcap=softcap,
    )
    assert [k.name.split("<")[0] for k in launcher.launches] == ["paged_prefill_attention_kernel"]


def test_windowed_decode_grid_sized_for_longer_contexts_gives_same_result(launcher):
    """Under CUDA graphs the host lengths say max_model_len: the grid covers the window, not the context."""
    gen = torch.Generator().manual_seed(9)
    batch = PagedBatch(gen, (140, 9), (1, 1), 8, 2, 16, torch.float32)
    batch.poison_outside_window(40)
    q = _rand(gen, 2, 4, 16)
    ops = _ops(launcher, decode_partition_size=32, decode_threads=32)
    want = ops.attention(q, batch.k_cache, batch.v_cache, step(ops, batch.meta), 0.25, sliding_window=40)
    padded = AttentionMetadata(
        slot_mapping=batch.meta.slot_mapping,
        query_start_loc=batch.meta.query_start_loc,
        seq_lens=batch.meta.seq_lens,
        block_tables=batch.meta.block_tables,
        query_lens_cpu=(1, 1),
        seq_lens_cpu=(1024, 1024),
        block_size=8,
    )
    first = len(launcher.launches)
    got = ops.attention(q, batch.k_cache, batch.v_cache, step(ops, padded), 0.25, sliding_window=40)
    assert torch.equal(got, want)
    assert launcher.launches[first].name.startswith("paged_decode_attention_kernel")
    assert launcher.grids[first] == (2, 2, 2)  # (sequences, KV heads, ceil(40 / 32) partitions)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,inter", [(1, 172), (5, 64), (3, 1001)])
def test_gelu_tanh_and_mul_matches_reference(launcher, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens * 11 + inter)
    x = _rand(gen, tokens, 2 * inter, dtype=dtype, scale=3.0)
    torch.testing.assert_close(_ops(launcher).gelu_tanh_and_mul(x), REF.gelu_tanh_and_mul(x), **TOL[dtype])
    assert [k.name.split("<")[0] for k in launcher.launches] == ["gelu_tanh_and_mul_kernel"]
