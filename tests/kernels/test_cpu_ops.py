"""CpuOps (kernels/cpu) against the torch reference ops (TorchOps), on every instruction set this CPU runs.

Each instruction set is forced in turn (AVX-512 with BF16, AVX-512, AVX2, portable C++), so an AVX-512
machine checks the AVX2 and portable paths too; a set the CPU cannot run is skipped with that reason.
Shapes include sizes that are not multiples of any vector width (masked tails), strided views of the
fused projections, block-table edges, GQA ratios 1 to 8, sliding windows over poisoned (freed) blocks
and soft-capping; the attention cases are the CUDA kernels' (test_ops_emulated).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_ops_emulated import (
    DECODE_CASES,
    PREFILL_CASES,
    TOL,
    PagedBatch,
    _check_attention,
    _check_rotary_on_fused_qkv,
    _check_write_kv,
    _cos_sin_cache,
    _meta_for_tokens,
    _rand,
    step,
)

from conduit_engine.errors import ModelLoadError
from conduit_engine.ops import cpu_kernels, cpu_ops
from conduit_engine.ops.cpu_ops import CpuOps, select_cpu_ops
from conduit_engine.ops.kv_quant import cache_layout
from conduit_engine.ops.torch_ops import TorchOps
from tests.support.shared import skip_or_fail

pytestmark = pytest.mark.kernels

REF = TorchOps()
DTYPES = (torch.float32, torch.bfloat16)
DTYPE_IDS = ["f32", "bf16"]


@pytest.fixture(scope="module")
def kernels():
    try:
        return cpu_kernels.load()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        skip_or_fail(f"the CPU kernels cannot be built here: {exc}")


@pytest.fixture(params=cpu_kernels.ISAS)
def ops(request, kernels) -> CpuOps:
    if request.param not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    return CpuOps(request.param, kernels)


# ---- linear --------------------------------------------------------------------------------------------

LINEAR_SHAPES = [
    # M (rows of x), N (outputs), K: vector tails (K % 16, K % 32), tile tails (N % 8, M % 4) and GEMV
    (1, 1, 1),
    (1, 37, 5),
    (1, 64, 768),
    (1, 9, 33),
    (2, 8, 16),
    (3, 17, 31),
    (5, 130, 100),
    (7, 3, 257),
    (16, 40, 64),
    (17, 11, 96),
    (64, 19, 48),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in LINEAR_SHAPES])
def test_linear_matches_reference(ops, dtype, bias, shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    x = _rand(gen, m, k, dtype=dtype)
    weight = _rand(gen, n, k, dtype=dtype, scale=k**-0.5)
    b = _rand(gen, n, dtype=dtype) if bias else None
    got = ops._k.linear_kernel(x, weight, b)  # the kernel itself, whatever CpuOps.linear picks for this M
    # float32 products of the same inputs; the kernel rounds once, at the end
    want = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(ops.linear(x, weight, b), REF.linear(x, weight, b), **TOL[dtype])


PACKED_SHAPES = [
    # M, N, K: panel tails (N % 32), odd K (bf16 k pairs), row blocks of 16 and their tails
    (1, 1, 1),
    (1, 33, 7),
    (2, 64, 768),
    (3, 95, 33),
    (16, 40, 64),
    (17, 32, 100),
    (40, 70, 31),
    (31, 40, 301),  # the panels' last row count before torch's GEMM, over three k slices of 128
    (33, 20, 300),  # float32: torch's GEMM from 32 rows, with the bias
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in PACKED_SHAPES])
def test_packed_linear_matches_reference(ops, dtype, bias, shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k + 1)
    x = _rand(gen, m, k, dtype=dtype)
    weight = _rand(gen, n, k, dtype=dtype, scale=k**-0.5)
    b = _rand(gen, n, dtype=dtype) if bias else None
    packed = ops._k.pack_linear(weight)
    assert (packed.out_features, packed.in_features) == (n, k)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(packed.forward(x, b), want, **TOL[dtype])
    ops.prepare_linear(weight)  # CpuOps.linear then takes the packed weight
    torch.testing.assert_close(ops.linear(x, weight, b), REF.linear(x, weight, b), **TOL[dtype])


def test_packed_linear_errors_name_the_argument(ops):
    packed = ops._k.pack_linear(torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match=r"linear: the weight is \[4, 8\], x has 7 columns"):
        packed.forward(torch.zeros(2, 7), None)
    with pytest.raises(RuntimeError, match="linear: x is BFloat16, the weight Float"):
        packed.forward(torch.zeros(2, 8, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="pack_linear: the CPU kernels take float32 or bfloat16"):
        ops._k.pack_linear(torch.zeros(4, 8, dtype=torch.float64))


def test_linear_reads_strided_rows_and_picks_torch_for_large_batches(ops):
    gen = torch.Generator().manual_seed(5)
    wide = _rand(gen, 6, 200)
    x = wide[:, 40:140]  # rows 200 apart
    weight = _rand(gen, 12, 100, scale=0.1)
    torch.testing.assert_close(ops.linear(x, weight), F.linear(x, weight), atol=2e-5, rtol=2e-5)
    big = _rand(gen, 300, 100)
    torch.testing.assert_close(ops.linear(big, weight), F.linear(big, weight), atol=2e-5, rtol=2e-5)


def test_linear_errors_name_the_argument(ops):
    x, weight = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops._k.linear_kernel(x.double(), weight.double(), None)
    with pytest.raises(RuntimeError, match=r"linear: weight is \[4, 7\], x has 8 columns"):
        ops._k.linear_kernel(x, torch.zeros(4, 7), None)
    with pytest.raises(RuntimeError, match="linear: bias must be contiguous"):
        ops._k.linear_kernel(x, weight, torch.zeros(5))
    with pytest.raises(RuntimeError, match="linear: weight: dtype"):
        ops._k.linear_kernel(x, weight.bfloat16(), None)


# ---- norms, activations, rotary, cache writes ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 96), (5, 200), (3, 1000), (2, 5)])
def test_norms_match_reference(ops, dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = _rand(gen, tokens, hidden, dtype=dtype, scale=2.0)
    residual = _rand(gen, tokens, hidden, dtype=dtype)
    weight = _rand(gen, hidden, dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5), **TOL[dtype])
    got, got_sum = ops.add_rms_norm(x, residual, weight, 1e-6)
    want, want_sum = REF.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=0)  # one rounding of x + residual
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_on_strided_rows_and_per_head(ops):
    gen = torch.Generator().manual_seed(3)
    wide = _rand(gen, 5, 160)
    x = wide[:, 16:80]
    weight = _rand(gen, 64)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), REF.rms_norm(x, weight, 1e-5))
    qkv = _rand(gen, 3, 96)
    heads = qkv[:, :64].view(3, 4, 16)  # a q view of a fused projection, normed per head (qk-norm)
    w16 = _rand(gen, 16)
    torch.testing.assert_close(ops.rms_norm(heads, w16, 1e-5), REF.rms_norm(heads, w16, 1e-5))


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens,inter", [(1, 172), (5, 64), (3, 1001), (2, 7)])
def test_gated_activations_match_reference(ops, op, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens * 7 + inter)
    x = _rand(gen, tokens, 2 * inter, dtype=dtype, scale=3.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-4])  # saturated exp and the tanh of tiny inputs
    torch.testing.assert_close(getattr(ops, op)(x), getattr(REF, op)(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 8, 4, 8), (9, 4, 1, 64), (3, 8, 8, 128), (2, 2, 1, 6)]
)
def test_rotary_on_fused_qkv_views_matches_reference(ops, dtype, tokens, heads, kv_heads, head_dim):
    _check_rotary_on_fused_qkv(ops, dtype, tokens, heads, kv_heads, head_dim)


def test_rotary_refuses_positions_outside_the_table(ops):
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match=r"rotary: position 300 outside \[0, 300\)"):
        ops._k.rotary(q, k, torch.tensor([300]), _cos_sin_cache(300, 8))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_write_kv_skips_negative_slots_and_reads_strided_views(ops, dtype):
    k, v, caches = _check_write_kv(ops, dtype)
    with pytest.raises(RuntimeError, match=r"write_kv: slot 24 outside \[-1, 24\)"):
        ops.write_kv(k[:1], v[:1], caches[0], caches[1], torch.tensor([24]))


# ---- attention -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"decode{i}" for i in range(len(DECODE_CASES))])
def test_decode_attention_matches_reference(ops, dtype, case):
    seq_lens, block_size, heads, kv_heads, head_dim, _, _, window, cap = case
    queries = [1] * len(seq_lens)
    seed = sum(seq_lens) + block_size
    _check_attention(ops, dtype, seq_lens, queries, block_size, heads, kv_heads, head_dim, seed, window, cap)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[f"prefill{i}" for i in range(len(PREFILL_CASES))])
def test_prefill_attention_matches_reference(ops, dtype, case):
    seq_lens, query_lens, block_size, heads, kv_heads, head_dim, window, cap = case
    seed = sum(seq_lens)
    _check_attention(
        ops, dtype, seq_lens, query_lens, block_size, heads, kv_heads, head_dim, seed, window, cap
    )


def test_attention_refuses_a_block_table_naming_a_missing_block(ops):
    gen = torch.Generator().manual_seed(1)
    batch = PagedBatch(gen, (20,), (1,), 16, 2, 8, torch.float32)
    batch.meta.block_tables[0, 1] = batch.k_cache.shape[0]
    q = _rand(gen, 1, 2, 8)
    with pytest.raises(RuntimeError, match="block table of sequence 0 names block"):
        ops.attention(q, batch.k_cache, batch.v_cache, step(ops, batch.meta), 1.0)


# ---- quantized KV caches (--kv-cache-dtype int8 | fp8) -----------------------------------------------

KV_DTYPES = ("int8", "fp8")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_quantized_write_kv_gives_the_reference_bytes(ops, dtype, kv_cache_dtype):
    """Codes and scales byte for byte as ops/kv_quant.py computes them, on strided views, slots -1
    skipped; rows of zeros, of one huge or tiny value (fp8 subnormals) and of ties included."""
    gen = torch.Generator().manual_seed(5)
    tokens, kv_heads, head_dim = 9, 3, 24
    kv = _rand(gen, tokens, 2 * kv_heads * head_dim, scale=3.0)
    kv[0] = 0.0
    kv[1, :head_dim] = torch.logspace(-12, 4, head_dim, base=2.0)  # codes down to fp8's subnormals
    kv[2, :head_dim] = torch.arange(head_dim) - 12.5  # half-way values: round to even
    kv = kv.to(dtype)
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([0, 5, -1, 23, 12, 7, 3, -1, 20])
    element, row = cache_layout(kv_cache_dtype, dtype, head_dim)
    caches = [torch.zeros(6, 4, kv_heads, row, dtype=element) for _ in range(4)]
    ops.write_kv(k, v, caches[0], caches[1], slots)
    REF.write_kv(k, v, caches[2], caches[3], slots)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fp8_codes_decode_as_torch_does():
    """Every finite e4m3fn code (and two zeros, to fill 16 rows of 16), as the values of a one-key
    attention (softmax weight 1: the output is the value itself), on every instruction set."""
    codes = [c for c in range(256) if c & 0x7F != 0x7F] + [0, 0]
    head_dim = 16
    rows = torch.zeros(len(codes) // head_dim, head_dim + 2, dtype=torch.uint8)
    rows[:, :head_dim] = torch.tensor(codes, dtype=torch.uint8).view(-1, head_dim)
    rows[:, head_dim:] = torch.ones(len(rows), 1, dtype=torch.bfloat16).view(torch.uint8)
    want = rows[:, :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    cache = torch.zeros(1, 16, len(rows), head_dim + 2, dtype=torch.uint8)
    cache[0, 0] = rows
    cache = cache.view(torch.float8_e4m3fn)
    q = torch.zeros(1, len(rows), head_dim)
    for isa in cpu_kernels.supported_isas():
        ops = CpuOps(isa)
        out = ops.attention(q, cache, cache, step(ops, _meta_for_tokens(1)), 1.0)
        assert torch.equal(out[0], want), isa


QUANT_DECODE = [DECODE_CASES[i] for i in (0, 1, 2, 4, 7, 10, 12)]
QUANT_PREFILL = [PREFILL_CASES[i] for i in (1, 2, 4, 6, 7, 9)]
# Kernels and reference dequantize the same codes; only the order of float sums differs (and in bf16,
# the reference's rounding of dequantized values to bf16).
QUANT_TOL = {torch.float32: {"atol": 5e-5, "rtol": 5e-5}, torch.bfloat16: TOL[torch.bfloat16]}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", QUANT_DECODE, ids=[f"decode{i}" for i in range(len(QUANT_DECODE))])
def test_decode_attention_over_quantized_caches_matches_reference(ops, dtype, kv_cache_dtype, case):
    seq_lens, block_size, heads, kv_heads, head_dim, _, _, window, cap = case
    _check_attention(
        ops,
        dtype,
        seq_lens,
        [1] * len(seq_lens),
        block_size,
        heads,
        kv_heads,
        head_dim,
        sum(seq_lens),
        window,
        cap,
        QUANT_TOL[dtype],
        kv_cache_dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", QUANT_PREFILL, ids=[f"prefill{i}" for i in range(len(QUANT_PREFILL))])
def test_prefill_attention_over_quantized_caches_matches_reference(ops, dtype, kv_cache_dtype, case):
    seq_lens, query_lens, block_size, heads, kv_heads, head_dim, window, cap = case
    _check_attention(
        ops,
        dtype,
        seq_lens,
        query_lens,
        block_size,
        heads,
        kv_heads,
        head_dim,
        sum(seq_lens),
        window,
        cap,
        QUANT_TOL[dtype],
        kv_cache_dtype,
    )


def test_quantized_cache_of_the_wrong_width_is_refused(ops):
    k = torch.zeros(1, 2, 8)
    cache = torch.zeros(4, 4, 2, 8, dtype=torch.int8)  # no room for the scales
    with pytest.raises(RuntimeError, match="write_kv: cache heads differ from k"):
        ops.write_kv(k, k, cache, cache.clone(), torch.tensor([0]))


# ---- the start-up choice -------------------------------------------------------------------------------


def test_choice_of_ops_at_start_up(kernels, caplog):
    caplog.set_level(logging.INFO, logger="conduit_engine.ops.cpu_ops")
    best = kernels.supported_isas()[0]
    auto = select_cpu_ops("auto")
    assert isinstance(auto, CpuOps) and auto.isa == best
    assert f"CPU ops: kernels/cpu for {best}" in caplog.text
    assert type(select_cpu_ops("torch")) is TorchOps
    assert select_cpu_ops("scalar").isa == "scalar"  # every CPU runs the portable build
    with pytest.raises(ModelLoadError, match="--cpu-kernels must be one of auto, torch, avx512bf16"):
        select_cpu_ops("sse4")
    for isa in set(cpu_kernels.ISAS) - set(kernels.supported_isas()):
        with pytest.raises(ModelLoadError, match=f"--cpu-kernels {isa}: this CPU runs only"):
            select_cpu_ops(isa)


def test_without_the_kernels_auto_falls_back_to_torch_and_says_why(monkeypatch, caplog):
    def unavailable() -> tuple[str, ...]:
        raise cpu_kernels.CpuKernelsUnavailable("no C++ compiler (g++) to build kernels/cpu")

    monkeypatch.setattr(cpu_ops.cpu_kernels, "supported_isas", unavailable)
    caplog.set_level(logging.INFO, logger="conduit_engine.ops.cpu_ops")
    assert type(select_cpu_ops("auto")) is TorchOps
    assert "CPU ops: torch, because the CPU kernels are unavailable: no C++ compiler" in caplog.text
    with pytest.raises(ModelLoadError, match="--cpu-kernels avx2: no C\\+\\+ compiler"):
        select_cpu_ops("avx2")
