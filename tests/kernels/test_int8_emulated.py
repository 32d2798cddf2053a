"""The CUDA int8 linear (kernels/int8_gemm.cu: per-token quantization, then the tensor-core GEMM on
mma.sync m16n8k32 s8) run by the CPU emulation through CudaOps' own wrapper, against the torch reference
(ops/quant.py): float32 outputs bit for bit (the same integers, the same float32 roundings), float16 and
bfloat16 within one rounding. Shapes cover a single decode row, partial warps and blocks (M off 16 and
64), N off the 32-column tile, K off the 32-wide k step (zero padding at load), and zero rows/channels."""

from __future__ import annotations

import pytest
import torch
from kernel_emulator import SHUFFLED

from conduit_engine.ops import quant
from conduit_engine.ops.cuda_ops import CudaOps

pytestmark = pytest.mark.kernels

SHAPES = [(1, 40, 64), (3, 33, 7), (17, 64, 96), (70, 8, 40), (16, 96, 33)]


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    weight[0] = 0.0
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    if m > 2:
        x[2] = 0.0
    return x, *quant.quantize_weight(weight), torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_int8_gemm_float32_is_the_reference_bit_for_bit(launcher, shape, with_bias):
    x, weight, scale, bias = _case(*shape, torch.float32, seed=sum(shape))
    ops = CudaOps(launcher)
    ops.prepare_linear(weight, scale)
    b = bias if with_bias else None
    out = ops.linear(x, weight, b, scale)
    assert torch.equal(out, quant.int8_linear(x, weight, scale, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_int8_gemm_half_dtypes_within_one_rounding(launcher, dtype):
    x, weight, scale, bias = _case(19, 48, 72, dtype, seed=11)
    out = CudaOps(launcher).linear(x, weight, bias, scale)
    ref = quant.int8_linear(x, weight, scale, bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-8 * float(ref.abs().max()))


def test_int8_gemm_any_thread_order(emu_build):
    """The kernel has no barriers to forget, but the warp-collective mma must still see every lane:
    shuffled thread order gives the same integers."""
    from kernel_emulator import EmulatedLauncher

    library, symbols = emu_build
    x, weight, scale, _ = _case(33, 40, 64, torch.float32, seed=5)
    out = CudaOps(EmulatedLauncher(library, symbols, schedule=SHUFFLED)).linear(x, weight, None, scale)
    assert torch.equal(out, quant.int8_linear(x, weight, scale))
