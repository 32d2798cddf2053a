"""The int8 linear of kernels/cpu (W8A8: VNNI, AVX-512 BW, AVX2 and portable tiles) against the torch
reference (ops/quant.py), on every instruction set this CPU runs, each forced in turn.

float32 outputs are the reference's bit for bit (the same int32 sums, the same three float roundings);
bfloat16 ones within one bfloat16 rounding. Shapes cover decode rows (GEMV), prefill blocks (GEMM) past
every tile height, N and K off every vector width and quad, all-zero rows, and the extreme values
(|x| at the row maximum gives q = ±127, which the sign-trick kernels must not saturate on)."""

from __future__ import annotations

import pytest
import torch

from conduit_engine.ops import cpu_kernels, quant
from conduit_engine.ops.cpu_ops import CpuOps
from tests.support.shared import skip_or_fail

pytestmark = pytest.mark.kernels

# (M, N, K): 1 and 2 rows (decode), tile tails (3, 5, 7, 9 rows), prefill blocks, K not a multiple of 4
SHAPES = [
    (1, 33, 7),
    (1, 512, 64),
    (2, 96, 130),
    (3, 64, 64),
    (5, 100, 129),
    (7, 31, 1),
    (9, 172, 64),
    (17, 64, 300),
    (64, 344, 64),
    (130, 40, 96),
]


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


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    weight[0] = 0.0  # an all-zero channel: scale 0
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    if m > 1:
        x[1] = 0.0  # an all-zero row: scale 0
    bias = torch.randn(n, generator=g).to(dtype)
    return x, *quant.quantize_weight(weight), bias


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_int8_linear_float32_is_the_reference_bit_for_bit(ops, shape, with_bias):
    x, weight, scale, bias = _case(*shape, torch.float32, seed=sum(shape))
    b = bias if with_bias else None
    ops.prepare_linear(weight, scale)
    out = ops.linear(x, weight, b, scale)
    assert out.dtype == torch.float32 and out.shape == (shape[0], shape[1])
    assert torch.equal(out, quant.int8_linear(x, weight, scale, b))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int8_linear_bfloat16_within_one_rounding(ops, shape):
    x, weight, scale, bias = _case(*shape, torch.bfloat16, seed=7 * sum(shape))
    out = ops.linear(x, weight, bias, scale)  # unprepared: packed on first use
    ref = quant.int8_linear(x, weight, scale, bias)
    assert out.dtype == torch.bfloat16
    # one bfloat16 rounding of the value, or of the product before the bias cancels it
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-8 * float(ref.abs().max()))


def test_int8_extremes_do_not_saturate(ops):
    """Every product at 127 * ±127 (x at its row maximum, weights at their channel maximum): the int16
    pairs of vpmaddubsw hold 2 * 127² exactly; the int32 sums stay exact."""
    k = 256
    weight = torch.full((64, k), 127, dtype=torch.int8)
    weight[1::2] = -127
    scale = torch.full((64,), 0.5)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    out = ops.linear(x, weight, None, scale)
    expected = quant.int8_linear(x, weight, scale)
    assert torch.equal(out, expected)
    assert out[0, 0] == 127 * 127 * k * 0.5 / 127


def test_decoder_stack_runs_int8_projections(ops):
    """A prepared int8 weight is found again by the weight alone (the compiled decoder's lookup); an
    unprepared one without its scales is refused."""
    x, weight, scale, _ = _case(4, 64, 64, torch.float32, seed=3)
    ops.prepare_linear(weight, scale)
    assert ops._packed_for(weight).is_int8
    with pytest.raises(ValueError, match="weight_scale"):
        ops._packed_for(weight.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantize_at_load_is_the_reference_bit_for_bit(ops, dtype):
    """CpuOps.quantize_weight (one threaded pass in C++) gives ops/quant.py's int8 values and scales,
    ties included: bfloat16 rows hold values at exactly half their maximum, where x * (127 / max) lands
    next to .5 and a reciprocal-then-multiply would round the other way."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 130, generator=g).to(dtype)
    weight[3] = 0.0
    weight[4, :2] = torch.tensor([2.0, 1.0], dtype=dtype)
    q, scale = ops.quantize_weight(weight)
    ref_q, ref_scale = quant.quantize_weight(weight)
    assert q.dtype == torch.int8 and torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
