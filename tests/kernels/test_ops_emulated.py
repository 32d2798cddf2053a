"""CudaOps on the CPU emulation of kernels/*.cu against the torch reference ops (TorchOps).

The wrappers in ops/cuda_ops.py run unchanged; only the launcher differs from the GPU path. Shapes are
random (fixed seeds) and include odd lengths, block-table edges, GQA ratios 1/4/8 and split-K on and off.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import DTYPES
from kernel_emulator import REVERSE, SHUFFLED, EmulatedLauncher

from conduit_engine.ops.base import AttentionMetadata, Ops, StepContext
from conduit_engine.ops.cuda_ops import CudaOps
from conduit_engine.ops.kv_quant import cache_layout, dequantize, is_quantized, quantize
from conduit_engine.ops.torch_ops import TorchOps

pytestmark = pytest.mark.kernels

REF = TorchOps()
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DTYPE_IDS = ["f32", "f16", "bf16"]


def _ops(launcher, **kwargs) -> CudaOps:
    return CudaOps(launcher, **kwargs)


def step(ops: Ops, meta: AttentionMetadata) -> StepContext:
    """The step context of an attention-only call: placeholder positions and RoPE table."""
    tokens = sum(meta.query_lens_cpu)
    return ops.begin_step(torch.zeros(tokens, dtype=torch.int64), meta, torch.zeros(1, 2))


def _meta_for_tokens(tokens: int) -> AttentionMetadata:
    """Metadata of one prefill sequence of `tokens` tokens (what a rotary-only call needs around it)."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        query_lens_cpu=(tokens,),
        seq_lens_cpu=(tokens,),
        block_size=16,
    )


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ---- norms, activation, rotary, cache writes -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 96), (5, 200), (3, 1000)])
def test_rms_norm_matches_reference(launcher, dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = _rand(gen, tokens, hidden, dtype=dtype, scale=2.0)
    weight = _rand(gen, hidden, dtype=dtype)
    got = _ops(launcher).rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, REF.rms_norm(x, weight, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (6, 72), (4, 333)])
def test_add_rms_norm_matches_reference(launcher, dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = _rand(gen, tokens, hidden, dtype=dtype)
    residual = _rand(gen, tokens, hidden, dtype=dtype)
    weight = _rand(gen, hidden, dtype=dtype)
    got, got_sum = _ops(launcher).add_rms_norm(x, residual, weight, 1e-6)
    want, want_sum = REF.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)  # one rounding of x + residual
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_on_strided_rows_and_3d_input(launcher):
    gen = torch.Generator().manual_seed(3)
    wide = _rand(gen, 5, 160)
    x = wide[:, 16:80]  # rows 160 apart, 64 wide: the kernel walks the stride, no copy
    weight = _rand(gen, 64)
    torch.testing.assert_close(_ops(launcher).rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5))
    heads = _rand(gen, 3, 4, 16)  # per-head norm (qk-norm) over the last dimension
    w16 = _rand(gen, 16)
    torch.testing.assert_close(_ops(launcher).rms_norm(heads, w16, 1e-5), REF.rms_norm(heads, w16, 1e-5))


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,inter", [(1, 172), (5, 64), (3, 1001)])
def test_gated_activations_match_reference(launcher, op, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens * 7 + inter)
    x = _rand(gen, tokens, 2 * inter, dtype=dtype, scale=3.0)
    torch.testing.assert_close(getattr(_ops(launcher), op)(x), getattr(REF, op)(x), **TOL[dtype])
    assert [k.name.split("<")[0] for k in launcher.launches] == [f"{op}_kernel"]


def _cos_sin_cache(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _check_rotary_on_fused_qkv(ops: Ops, dtype, tokens: int, heads: int, kv_heads: int, head_dim: int):
    """`ops.rotary_embedding` on q/k views of a fused qkv row against TorchOps' (also run by test_cpu_ops)."""
    gen = torch.Generator().manual_seed(tokens + heads + head_dim)
    qkv = _rand(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    cache = _cos_sin_cache(300, head_dim)
    ref_qkv = qkv.clone()
    for buf, backend in ((qkv, ops), (ref_qkv, REF)):
        q = buf[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = buf[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        backend.rotary_embedding(q, k, backend.begin_step(positions, _meta_for_tokens(tokens), cache))
    torch.testing.assert_close(qkv, ref_qkv, **TOL[dtype])  # v is untouched in both


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 8, 4, 8), (9, 4, 1, 64), (3, 8, 8, 128)])
def test_rotary_on_fused_qkv_views_matches_reference(launcher, dtype, tokens, heads, kv_heads, head_dim):
    _check_rotary_on_fused_qkv(_ops(launcher), dtype, tokens, heads, kv_heads, head_dim)


def _check_write_kv(ops: Ops, dtype) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`ops.write_kv` of strided k/v views, some slots -1, against TorchOps' (also run by test_cpu_ops);
    returns k, v and the caches written."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 16, 7
    kv = _rand(gen, tokens, 2 * kv_heads * head_dim, dtype=dtype)
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([0, 5, -1, 23, 12, -1, 3])
    caches = [_rand(gen, num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    ref = [c.clone() for c in caches]
    ops.write_kv(k, v, caches[0], caches[1], slots)
    REF.write_kv(k, v, ref[0], ref[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    return k, v, caches


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_write_kv_skips_negative_slots_and_reads_strided_views(launcher, dtype):
    _check_write_kv(_ops(launcher), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 8), (4, 1, 64), (8, 8, 128)])
def test_fused_rotary_and_kv_write_matches_the_two_reference_ops(launcher, dtype, heads, kv_heads, head_dim):
    """One launch: q rotated in place, rotated k and v into the caches at the step's slots (-1 skipped),
    on views of a fused qkv row, exactly as TorchOps' rotary_embedding then write_kv."""
    gen = torch.Generator().manual_seed(heads + head_dim)
    tokens, num_blocks, block_size = 7, 6, 4
    qkv = _rand(gen, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    slots = torch.tensor([0, 5, -1, 23, 12, -1, 3])
    meta = dataclasses.replace(_meta_for_tokens(tokens), slot_mapping=slots)
    caches = [_rand(gen, num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    results = []
    for backend in (_ops(launcher), REF):
        buf, k_cache, v_cache = qkv.clone(), caches[0].clone(), caches[1].clone()
        q = buf[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = buf[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        v = buf[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        step_ = backend.begin_step(positions, meta, _cos_sin_cache(300, head_dim))
        backend.rotary_and_write_kv(q, k, v, k_cache, v_cache, step_)
        results.append((q.clone(), k_cache, v_cache))
    (q, k_cache, v_cache), (ref_q, ref_k, ref_v) = results
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_cache, ref_k, **TOL[dtype])
    assert torch.equal(v_cache, ref_v)
    assert [k.name.split("<")[0] for k in launcher.launches] == ["rotary_write_kv_kernel"]


# ---- quantized KV caches (--kv-cache-dtype int8 | fp8) -----------------------------------------------

KV_DTYPES = ("int8", "fp8")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_quantized_write_kv_gives_the_reference_bytes(launcher, dtype, kv_cache_dtype):
    """write_kv_quant_kernel: codes and scales byte for byte as ops/kv_quant.py computes them (strided
    views, slots -1 skipped, a row of zeros, values down to fp8's subnormals, half-way ties)."""
    gen = torch.Generator().manual_seed(5)
    tokens, kv_heads, head_dim = 7, 2, 16
    kv = _rand(gen, tokens, 2 * kv_heads * head_dim, scale=3.0)
    kv[0] = 0.0
    kv[1, :head_dim] = torch.logspace(-12, 4, head_dim, base=2.0)
    kv[2, :head_dim] = torch.arange(head_dim) - 7.5
    kv = kv.to(dtype)
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([0, 5, -1, 23, 12, -1, 3])
    element, row = cache_layout(kv_cache_dtype, dtype, head_dim)
    caches = [torch.zeros(6, 4, kv_heads, row, dtype=element) for _ in range(4)]
    _ops(launcher).write_kv(k, v, caches[0], caches[1], slots)
    REF.write_kv(k, v, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert [k.name.split("<")[0] for k in launcher.launches] == ["write_kv_quant_kernel"]


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_rotary_and_quantized_kv_write_match_the_reference(launcher, kv_cache_dtype):
    """Quantized caches take the rotated keys (rotary, then the quantizing write: a row's scale needs
    all its values); rotary's float rounding may move a code by one step, nothing more."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim = 7, 8, 4, 8
    qkv = _rand(gen, tokens, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    meta = dataclasses.replace(_meta_for_tokens(tokens), slot_mapping=torch.tensor([0, 5, -1, 23, 12, -1, 3]))
    element, row = cache_layout(kv_cache_dtype, torch.float32, head_dim)
    results = []
    for backend in (_ops(launcher), REF):
        buf = qkv.clone()
        k_cache, v_cache = (torch.zeros(6, 4, kv_heads, row, dtype=element) for _ in range(2))
        q = buf[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = buf[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        v = buf[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        backend.rotary_and_write_kv(
            q, k, v, k_cache, v_cache, backend.begin_step(positions, meta, _cos_sin_cache(300, head_dim))
        )
        results.append((q.clone(), dequantize(k_cache), v_cache))
    (q, k_values, v_cache), (ref_q, ref_k, ref_v) = results
    torch.testing.assert_close(q, ref_q, **TOL[torch.float32])
    torch.testing.assert_close(k_values, ref_k, rtol=0.07, atol=0.05)
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_quantized_blocks_gather_and_scatter_as_bytes(launcher, kv_cache_dtype):
    gen = torch.Generator().manual_seed(9)
    element, row = cache_layout(kv_cache_dtype, torch.float32, 8)
    caches = [tuple(quantize(_rand(gen, 10, 4, 3, 8), element) for _ in range(2)) for _ in range(2)]
    ids = torch.tensor([7, 0, 3])
    buffer = _ops(launcher).gather_kv_blocks(caches, ids)
    want = REF.gather_kv_blocks(caches, ids)
    assert buffer.dtype == element and torch.equal(buffer.view(torch.uint8), want.view(torch.uint8))
    blank = [tuple(torch.zeros_like(c) for c in pair) for pair in caches]
    _ops(launcher).scatter_kv_blocks(buffer, blank, ids)
    for pair, back in zip(caches, blank, strict=True):
        for c, b in zip(pair, back, strict=True):
            assert torch.equal(c.view(torch.uint8)[ids], b.view(torch.uint8)[ids])


# ---- attention -----------------------------------------------------------------------------------------


class PagedBatch:
    """Random paged KV caches holding `seq_lens` tokens per sequence, plus the step's metadata."""

    def __init__(
        self,
        gen,
        seq_lens,
        query_lens,
        block_size,
        kv_heads,
        head_dim,
        dtype,
        spare_blocks=3,
        kv_cache_dtype="auto",
    ):
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        perm = torch.randperm(num_blocks, generator=gen)
        width = max(blocks_per_seq) + 1  # one padding column of zeros past the longest table
        table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks_per_seq):
            table[i, :n] = perm[used : used + n].to(torch.int32)
            used += n
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = _rand(gen, *shape, dtype=dtype)
        self.v_cache = _rand(gen, *shape, dtype=dtype)
        if kv_cache_dtype != "auto":  # the same values as codes and scales (ops/kv_quant.py)
            element, _ = cache_layout(kv_cache_dtype, dtype, head_dim)
            self.k_cache, self.v_cache = quantize(self.k_cache, element), quantize(self.v_cache, element)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        slot_mapping = []
        for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
            for pos in range(n - q, n):
                slot_mapping.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table,
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
            block_size=block_size,
        )

    def poison_outside_window(self, window: int | None) -> None:
        """Point every table entry of a block wholly below its sequence's windows (as the block manager
        frees them) at one spare block full of NaN: whoever reads one, even to mask it, returns NaN."""
        if window is None:
            return
        meta, bs = self.meta, self.meta.block_size
        used = {
            int(b)
            for i, n in enumerate(meta.seq_lens_cpu)
            for b in meta.block_tables[i, : -(-n // bs)].tolist()
        }
        poison = min(set(range(self.k_cache.shape[0])) - used)
        for cache in (self.k_cache, self.v_cache):
            if is_quantized(cache):  # all bytes 0xFF: a NaN scale (and a NaN fp8 code)
                cache.view(torch.uint8)[poison] = 0xFF
            else:
                cache[poison] = float("nan")
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            lowest_visible = max(0, seq_len - q_len - window + 1)
            for block in range(lowest_visible // bs):  # blocks ending before the lowest visible key
                meta.block_tables[i, block] = poison


def _check_attention(
    ops: Ops,
    dtype,
    seq_lens,
    query_lens,
    block_size,
    heads,
    kv_heads,
    head_dim,
    seed,
    sliding_window=None,
    logit_softcap=None,
    tol=None,
    kv_cache_dtype="auto",
):
    """`ops.attention` against TorchOps' on random paged caches (also run by test_cpu_ops on CpuOps),
    in the compute dtype or quantized (`kv_cache_dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    batch = PagedBatch(
        gen, seq_lens, query_lens, block_size, kv_heads, head_dim, dtype, kv_cache_dtype=kv_cache_dtype
    )
    batch.poison_outside_window(sliding_window)
    q = _rand(gen, sum(query_lens), heads, head_dim, dtype=dtype, scale=2.0 if logit_softcap else 1.0)
    scale = head_dim**-0.5
    args = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    got = ops.attention(q, batch.k_cache, batch.v_cache, step(ops, batch.meta), scale, **args)
    want = REF.attention(q, batch.k_cache, batch.v_cache, step(REF, batch.meta), scale, **args)
    assert not want.isnan().any() and not got.isnan().any()
    torch.testing.assert_close(got, want, **(tol or TOL[dtype]))
    return got


DECODE_CASES = [
    # seq_lens, block_size, heads, kv_heads, head_dim, partition, threads (split-K off when partition > len),
    # sliding window, logit soft-cap (blocks below a window are poisoned: PagedBatch.poison_outside_window)
    ((1, 17, 5), 16, 8, 8, 8, 512, 128, None, None),  # GQA 1, one-token context, short contexts
    ((33, 64, 127), 1, 8, 2, 64, 512, 128, None, None),  # GQA 4, block size 1
    ((130, 65, 257), 32, 16, 2, 64, 64, 64, None, None),  # GQA 8, split-K with 64-token partitions
    ((200, 1, 96), 64, 4, 1, 128, 64, 64, None, None),  # GQA 4 (MQA), split-K, one sequence in one partition
    ((48, 16), 16, 8, 4, 8, 32, 32, None, None),  # stories260K shape, contexts on block edges, split-K
    ((300, 64, 97), 8, 8, 1, 64, 128, 32, None, None),  # GQA 8, split-K, 4 tiles per partition (rescale)
    ((77, 500), 2, 4, 4, 16, 512, 64, None, None),  # GQA 1, no split, 8 tiles in one partition
    ((40, 9, 100), 4, 8, 2, 16, 512, 64, 8, None),  # windows inside long contexts, one shorter than it
    ((300, 70), 8, 8, 1, 64, 64, 32, 130, None),  # split-K over the window only: 3 partitions, not 5
    ((50, 3), 16, 4, 4, 32, 32, 32, None, 5.0),  # soft-capping alone, split-K
    ((77, 20, 1), 2, 4, 2, 16, 32, 32, 33, 2.5),  # both, split-K, a one-token context
    ((64, 65), 16, 4, 4, 8, 512, 32, 1, None),  # window 1: each query sees only itself
    ((90, 257), 16, 32, 4, 256, 128, 128, None, None),  # GQA 8, head_dim 256: float32 reads 2 chunks a lane
    ((40, 3), 8, 12, 1, 64, 512, 64, None, None),  # GQA 12: a pass of 8 heads, then one of 4
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"decode{i}" for i in range(len(DECODE_CASES))])
def test_decode_attention_matches_reference(launcher, dtype, case):
    seq_lens, block_size, heads, kv_heads, head_dim, partition, threads, window, softcap = case
    _check_attention(
        _ops(launcher, decode_partition_size=partition, decode_threads=threads),
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
    )
    split = min(max(seq_lens), window or max(seq_lens)) > partition
    names = [k.name.split("<")[0] for k in launcher.launches]
    # One launch either way: the last partition to finish combines the split.
    assert names == ["paged_decode_attention_kernel"]
    assert launcher.grids[0][2] > 1 if split else launcher.grids[0][2] == 1


PREFILL_CASES = [
    # seq_lens, query_lens, block_size, heads, kv_heads, head_dim, sliding window, logit soft-cap
    ((7,), (7,), 4, 8, 8, 8, None, None),  # one fresh prompt, odd length, GQA 1
    ((19, 40, 5), (19, 9, 1), 16, 8, 2, 64, None, None),  # fresh prompt + chunk after 31 cached + a decode
    ((70, 33), (37, 33), 8, 8, 1, 64, None, None),  # GQA 8, 33 cached tokens (prefix hit), multi-tile keys
    ((50,), (17,), 32, 4, 1, 128, None, None),  # chunked prefill across a 32-token block edge
    ((16, 3), (16, 2), 16, 8, 4, 8, None, None),  # stories260K shape, exactly one block
    ((30,), (30,), 4, 8, 2, 8, 8, None),  # a fresh prompt longer than the window
    ((70, 33), (37, 33), 8, 8, 1, 64, 20, 3.0),  # a chunk after 33 cached tokens, window and soft-capping
    ((50, 5), (17, 1), 16, 4, 1, 128, 16, None),  # a chunk whose window starts mid-block, a decode row
    ((40,), (40,), 4, 4, 4, 8, 1, None),  # window 1
    ((90, 18), (70, 18), 4, 8, 2, 64, None, 1.5),  # soft-capping alone, several key tiles
    # Shapes for the tensor-core kernel (64 query rows, 64 or 32 keys a tile): several row blocks and key
    # tiles, head_dim 256, GQA 1/4/8, windows that start inside a row block, chunks over cached prefixes.
    ((130, 70), (100, 70), 16, 8, 1, 256, None, None),  # GQA 8, 30 cached, two row blocks
    ((150,), (150,), 16, 4, 1, 128, 48, 2.0),  # GQA 4, window and soft-cap across row blocks
    ((100, 40), (36, 40), 8, 4, 4, 256, 30, None),  # GQA 1, window, 64 cached
    ((200, 9), (80, 9), 16, 8, 2, 64, None, 5.0),  # GQA 4, a chunk after 120 cached, soft-cap
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"prefill{i}" for i in range(len(PREFILL_CASES))])
def test_prefill_attention_matches_reference(launcher, dtype, case):
    seq_lens, query_lens, block_size, heads, kv_heads, head_dim, window, softcap = case
    _check_attention(
        _ops(launcher),
        dtype,
        seq_lens,
        query_lens,
        block_size,
        heads,
        kv_heads,
        head_dim,
        seed=sum(seq_lens),
        sliding_window=window,
        logit_softcap=softcap,
        # The tensor-core kernel rounds P to the model dtype before P V, as FlashAttention does: one more
        # float16 rounding (2^-11) than the float32 kernel, in a few elements just past TOL's 2e-3.
        tol={"atol": 4e-3, "rtol": 4e-3} if dtype == torch.float16 else None,
    )
    tensor_cores = dtype != torch.float32 and head_dim % 16 == 0
    kernel = "paged_prefill_attention_mma_kernel" if tensor_cores else "paged_prefill_attention_kernel"
    assert [k.name.split("<")[0] for k in launcher.launches] == [kernel]


def test_prefill_without_tensor_cores_runs_the_float32_kernel(launcher):
    """CudaOps(tensor_cores=False) (a pre-sm_80 GPU) keeps bf16 prefill on the float32 kernel."""
    seq_lens, query_lens, block_size, heads, kv_heads, head_dim, window, softcap = PREFILL_CASES[2]
    args = (seq_lens, query_lens, block_size, heads, kv_heads, head_dim)
    _check_attention(_ops(launcher, tensor_cores=False), torch.bfloat16, *args, seed=3)
    assert [k.name.split("<")[0] for k in launcher.launches] == ["paged_prefill_attention_kernel"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_splits_long_contexts_by_itself(launcher, dtype):
    """Without decode_partition_size, split-K follows sequences x KV heads against the SM count (16 when
    the launcher does not say): two sequences of one KV head over 2,000 tokens split into 384-token
    partitions (6 of them), combined by the last of each sequence's to finish; the counters are back
    at zero for the next launch, which gives the same result."""
    ops = _ops(launcher)
    first = _check_attention(ops, dtype, (2000, 700), [1, 1], 16, 4, 1, 64, seed=11)
    assert [k.name.split("<")[0] for k in launcher.launches] == ["paged_decode_attention_kernel"]
    assert launcher.grids[0] == (2, 1, 6)
    assert not ops._counters.any()
    assert torch.equal(_check_attention(ops, dtype, (2000, 700), [1, 1], 16, 4, 1, 64, seed=11), first)


@pytest.mark.parametrize(("window", "partitions"), [(None, 8), (40, 2)], ids=["full", "window40"])
def test_decode_grid_sized_for_longer_contexts_gives_same_result(launcher, window, partitions):
    """Under CUDA graphs the grid is sized for max_model_len (256 here): extra partitions must exit
    cleanly; with a window the grid covers only the window (ceil(40 / 32) partitions)."""
    gen = torch.Generator().manual_seed(5)
    batch = PagedBatch(gen, (140, 9), (1, 1), 8, 2, 16, torch.float32)
    batch.poison_outside_window(window)
    q = _rand(gen, 2, 4, 16)
    ops = _ops(launcher, decode_partition_size=32, decode_threads=32)
    want = ops.attention(q, batch.k_cache, batch.v_cache, step(ops, batch.meta), 0.25, sliding_window=window)
    padded_meta = AttentionMetadata(
        slot_mapping=batch.meta.slot_mapping,
        query_start_loc=batch.meta.query_start_loc,
        seq_lens=batch.meta.seq_lens,
        block_tables=batch.meta.block_tables,
        query_lens_cpu=(1, 1),
        seq_lens_cpu=(256, 256),  # host copy says "up to 256"
        block_size=8,
    )
    first = len(launcher.launches)
    got = ops.attention(q, batch.k_cache, batch.v_cache, step(ops, padded_meta), 0.25, sliding_window=window)
    assert torch.equal(got, want)
    assert launcher.launches[first].name.startswith("paged_decode_attention_kernel")
    assert launcher.grids[first] == (2, 2, partitions)  # (sequences, KV heads, partitions)


@pytest.mark.parametrize("schedule", [REVERSE, SHUFFLED], ids=["reverse", "shuffled"])
def test_kernels_are_race_free_under_other_schedules(emu_build, schedule):
    """Bit-identical results when the emulator resumes threads in another order between barriers."""
    library, symbols = emu_build
    results = []
    for order in (0, schedule):
        launcher = EmulatedLauncher(library, symbols, schedule=order, seed=7)
        gen = torch.Generator().manual_seed(21)
        ops = _ops(launcher, decode_partition_size=64, decode_threads=64)
        decode = PagedBatch(gen, (150, 3), (1, 1), 16, 1, 64, torch.float16)
        prefill = PagedBatch(gen, (40, 21), (30, 21), 8, 2, 64, torch.bfloat16)
        q_dec = _rand(gen, 2, 4, 64, dtype=torch.float16)
        q_pre = _rand(gen, 51, 4, 64, dtype=torch.bfloat16)
        # Tensor cores over two row blocks and several key tiles with a window; the float32 kernel.
        long = PagedBatch(gen, (150,), (120,), 16, 1, 128, torch.float16)
        q_long = _rand(gen, 120, 4, 128, dtype=torch.float16)
        simt = PagedBatch(gen, (40,), (40,), 8, 2, 64, torch.float32)
        q_simt = _rand(gen, 40, 4, 64)
        x = _rand(gen, 3, 96)
        results.append(
            [
                ops.attention(q_dec, decode.k_cache, decode.v_cache, step(ops, decode.meta), 0.125),
                ops.attention(q_pre, prefill.k_cache, prefill.v_cache, step(ops, prefill.meta), 0.125),
                ops.attention(
                    q_long, long.k_cache, long.v_cache, step(ops, long.meta), 0.09, sliding_window=70
                ),
                ops.attention(q_simt, simt.k_cache, simt.v_cache, step(ops, simt.meta), 0.125),
                ops.add_rms_norm(x, x.flip(0), torch.ones(96), 1e-5)[0],
            ]
        )
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)


# ---- grammar bitmask -----------------------------------------------------------------------------------


def _bitmask_case(gen, batch, vocab, rows):
    logits = _rand(gen, batch, vocab, scale=3.0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), words), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    bitmask[0, 0] = -1  # a word with every bit set (all allowed) and one with none
    if words > 1:
        bitmask[-1, 1] = 0
    return logits, bitmask, torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize(
    "batch,vocab,rows,threads",
    [(5, 37, [3, 0, 4], 32), (8, 512, [7, 2, 5, 0], 128), (3, 1000, [1], 64), (6, 2049, [5, 1, 2, 4], 256)],
)
def test_apply_token_bitmask_matches_reference(launcher, batch, vocab, rows, threads):
    """Vocabularies that are not multiples of 32 (bits past the end ignored) and rows out of order."""
    gen = torch.Generator().manual_seed(batch * vocab)
    logits, bitmask, row_ids = _bitmask_case(gen, batch, vocab, rows)
    want = logits.clone()
    REF.apply_token_bitmask(want, bitmask, row_ids)
    got = logits.clone()
    _ops(launcher, bitmask_threads=threads).apply_token_bitmask(got, bitmask, row_ids)
    assert torch.equal(got, want)
    for row in set(range(batch)) - set(rows):
        assert torch.equal(got[row], logits[row])  # unlisted rows untouched


def test_apply_token_bitmask_on_strided_logits_skips_rows_outside(launcher):
    gen = torch.Generator().manual_seed(4)
    wide = _rand(gen, 4, 300)
    logits, bitmask, rows = wide[:, :100], *_bitmask_case(gen, 4, 100, [2, 0])[1:]
    want = logits.clone()
    REF.apply_token_bitmask(want, bitmask, rows)
    before = wide.clone()
    ops = _ops(launcher, bitmask_threads=32)
    ops.apply_token_bitmask(logits, bitmask, rows)  # rows 300 apart: written in place through the view
    assert torch.equal(logits, want) and torch.equal(wide[:, 100:], before[:, 100:])
    ops.apply_token_bitmask(logits, bitmask, torch.tensor([-1, 4]))  # outside [0, 4): never written
    assert torch.equal(logits, want)


# ---- KV block gather / scatter (disaggregation transfer buffers) -----------------------------------------

KV_TRANSFER_SHAPES = {
    # (layers, cache blocks, block_size, kv_heads, head_dim): stories260K-like, a 64-dim model, and a
    # block of 2*1*5 = 10 elements, which is no whole number of 16-byte packs (element-wise path).
    "small": (2, 12, 4, 2, 8),
    "wide": (3, 40, 16, 2, 64),
    "odd": (2, 9, 2, 1, 5),
}
KV_BLOCK_LISTS = {"one": [7], "scattered": [5, 0, 8, 2], "many_reversed": list(range(8, -1, -1))}


def kv_transfer_cases(test):
    """Every dtype x cache shape x block list."""
    for name, cases in (("dtype", DTYPES), ("shape", KV_TRANSFER_SHAPES), ("blocks", KV_BLOCK_LISTS)):
        values, ids = (cases, DTYPE_IDS) if name == "dtype" else (list(cases.values()), list(cases))
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


def _kv_caches(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> list:
    layers, *cache_shape = shape
    return [
        (_rand(gen, *cache_shape, dtype=dtype), _rand(gen, *cache_shape, dtype=dtype)) for _ in range(layers)
    ]


@kv_transfer_cases
def test_gather_kv_blocks_matches_reference_and_the_chunk_layout(launcher, dtype, shape, blocks):
    gen = torch.Generator().manual_seed(len(blocks) * 31 + shape[1])
    caches = _kv_caches(gen, shape, dtype)
    ids = torch.tensor(blocks, dtype=torch.int64)
    got = _ops(launcher).gather_kv_blocks(caches, ids)
    want = REF.gather_kv_blocks(caches, ids)
    assert got.shape == (shape[0], 2, len(blocks), *shape[2:]) and got.is_contiguous()
    assert torch.equal(got, want)
    for layer, (k, v) in enumerate(caches):  # [layer][k, v][block]...: the KvChunk payload layout
        for j, block in enumerate(blocks):
            assert torch.equal(want[layer, 0, j], k[block]) and torch.equal(want[layer, 1, j], v[block])


def test_gather_kv_blocks_writes_into_out_such_as_a_shared_memory_buffer(launcher):
    """`out` (here a tensor over a writable bytearray, as over a mapped segment) receives the payload."""
    gen = torch.Generator().manual_seed(5)
    caches = _kv_caches(gen, (2, 6, 4, 2, 8), torch.float32)
    ids = torch.tensor([4, 0, 5], dtype=torch.int64)
    want = REF.gather_kv_blocks(caches, ids)
    for ops in (REF, _ops(launcher)):
        memory = bytearray(want.numel() * 4)
        out = torch.frombuffer(memory, dtype=torch.float32).view(want.shape)
        assert ops.gather_kv_blocks(caches, ids, out=out) is out
        assert torch.equal(out, want) and bytes(memory) == want.numpy().tobytes()
        with pytest.raises(ValueError, match=r"out: expected shape \(2, 2, 3, 4, 2, 8\)"):
            ops.gather_kv_blocks(caches, ids, out=out[:, :, :2])


@kv_transfer_cases
def test_scatter_kv_blocks_matches_reference_and_touches_only_its_blocks(launcher, dtype, shape, blocks):
    gen = torch.Generator().manual_seed(len(blocks) * 17 + shape[1])
    caches = _kv_caches(gen, shape, dtype)
    buffer = _rand(gen, shape[0], 2, len(blocks), *shape[2:], dtype=dtype)
    ids = torch.tensor(blocks, dtype=torch.int64)
    want = [(k.clone(), v.clone()) for k, v in caches]
    REF.scatter_kv_blocks(buffer, want, ids)
    before = [(k.clone(), v.clone()) for k, v in caches]
    _ops(launcher).scatter_kv_blocks(buffer, caches, ids)
    untouched = [b for b in range(shape[1]) if b not in blocks]
    for (k, v), (wk, wv), (bk, bv) in zip(caches, want, before, strict=True):
        assert torch.equal(k, wk) and torch.equal(v, wv)
        assert torch.equal(k[untouched], bk[untouched]) and torch.equal(v[untouched], bv[untouched])
    assert torch.equal(_ops(launcher).gather_kv_blocks(caches, ids), buffer)  # the round trip


def test_scatter_kv_blocks_reads_an_unaligned_buffer_element_by_element(launcher):
    """A contiguous buffer that starts 4 bytes past a 16-byte boundary takes the scalar path."""
    gen = torch.Generator().manual_seed(11)
    caches = _kv_caches(gen, (2, 6, 4, 2, 8), torch.float32)
    flat = _rand(gen, 2 * 2 * 3 * 4 * 2 * 8 + 1)
    buffer = flat[1:].view(2, 2, 3, 4, 2, 8)
    assert buffer.data_ptr() % 16 != 0
    ids = torch.tensor([4, 1, 3], dtype=torch.int64)
    want = [(k.clone(), v.clone()) for k, v in caches]
    REF.scatter_kv_blocks(buffer, want, ids)
    _ops(launcher).scatter_kv_blocks(buffer, caches, ids)
    assert all(
        torch.equal(k, wk) and torch.equal(v, wv) for (k, v), (wk, wv) in zip(caches, want, strict=True)
    )


# ---- attention over quantized KV caches ----------------------------------------------------------------

QUANT_DECODE = [DECODE_CASES[i] for i in (0, 2, 4, 7, 10, 12)]
QUANT_PREFILL = [PREFILL_CASES[i] for i in (1, 4, 6, 10)]
QUANT_TOL = {
    torch.float32: {"atol": 5e-5, "rtol": 5e-5},
    torch.float16: TOL[torch.float16],
    torch.bfloat16: TOL[torch.bfloat16],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", QUANT_DECODE, ids=[f"decode{i}" for i in range(len(QUANT_DECODE))])
def test_decode_attention_over_quantized_caches_matches_reference(launcher, dtype, kv_cache_dtype, case):
    seq_lens, block_size, heads, kv_heads, head_dim, partition, threads, window, softcap = case
    _check_attention(
        _ops(launcher, decode_partition_size=partition, decode_threads=threads),
        dtype,
        seq_lens,
        [1] * len(seq_lens),
        block_size,
        heads,
        kv_heads,
        head_dim,
        sum(seq_lens) + block_size,
        window,
        softcap,
        QUANT_TOL[dtype],
        kv_cache_dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", QUANT_PREFILL, ids=[f"prefill{i}" for i in range(len(QUANT_PREFILL))])
def test_prefill_attention_over_quantized_caches_matches_reference(launcher, dtype, kv_cache_dtype, case):
    """The float32 prefill kernel dequantizes the tiles it stages (never the tensor-core one)."""
    seq_lens, query_lens, block_size, heads, kv_heads, head_dim, window, softcap = case
    _check_attention(
        _ops(launcher),
        dtype,
        seq_lens,
        query_lens,
        block_size,
        heads,
        kv_heads,
        head_dim,
        sum(seq_lens),
        window,
        softcap,
        QUANT_TOL[dtype],
        kv_cache_dtype,
    )
    assert all("mma" not in k.name for k in launcher.launches)
