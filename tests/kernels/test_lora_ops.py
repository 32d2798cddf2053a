"""Ops.lora_delta: the CPU kernels (every instruction set this CPU runs) against the torch reference, and
the reference against a plain per-row formula, on pools with several slots, ranks padded with zeros,
fused outputs of three slices and rows of mixed adapters (contiguous runs and scattered rows)."""

from __future__ import annotations

import pytest
import torch

from conduit_engine.ops import LoraBatch, LoraWeights, cpu_kernels
from conduit_engine.ops.cpu_ops import CpuOps
from conduit_engine.ops.torch_ops import TorchOps
from tests.support.shared import skip_or_fail

pytestmark = pytest.mark.kernels

REF = TorchOps()
# (row slots, the output slices, K, rank)
CASES = [
    ([0, 0, 0, -1, 1, 1], (24, 8, 8), 40, 8),  # prefill-like runs, a base row between
    ([1, -1, 0, 1, 2, 0, -1, 2], (33,), 17, 4),  # decode rows of three adapters, interleaved
    ([-1, -1], (16, 16), 8, 16),  # no adapter rows
    ([2] * 70, (96, 96), 64, 16),  # many rows of one adapter: two segments
]
# and for the CPU kernels' tiles (kernels_impl.h: LoRA)
CPU_CASES = [
    *CASES,
    ([t % 8 for t in range(16)], (64, 32, 32), 48, 16),  # a decode batch: 8 adapters x 2 rows
    # a prefill of scattered rows of four adapters and the base model: segments, a first slice wider than
    # an expand panel, column and K tails, a rank that is no multiple of the shrink tile
    ([t % 5 - 1 for t in range(150)], (300, 41, 39), 75, 6),
]


def make_case(slots, splits, k, rank, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_slots, n = max(3, max(slots) + 1), sum(splits)
    a = torch.randn(num_slots, len(splits), rank, k, generator=gen).to(dtype)
    b = torch.randn(num_slots, len(splits) * rank, n, generator=gen)
    start = 0
    for j, width in enumerate(splits):  # block-diagonal: slice j's columns read shrink slice j only
        b[:, : j * rank, start : start + width] = 0
        b[:, (j + 1) * rank :, start : start + width] = 0
        start += width
    b = b.to(dtype)
    a[..., rank // 2 :, :] = 0  # an adapter of half the pool's rank (padded with zeros)
    x = torch.randn(len(slots), k, generator=gen).to(dtype)
    y = torch.randn(len(slots), n, generator=gen).to(dtype)
    return LoraWeights(a, b, tuple(splits)), x, y, batch_of(slots)


def batch_of(slots: list[int]) -> LoraBatch:
    runs: dict[int, list[tuple[int, int]]] = {}
    for t, s in enumerate(slots):
        if s < 0:
            continue
        spans = runs.setdefault(s, [])
        if spans and spans[-1][1] == t:
            spans[-1] = (spans[-1][0], t + 1)
        else:
            spans.append((t, t + 1))
    return LoraBatch(torch.tensor(slots, dtype=torch.int32), tuple((s, tuple(r)) for s, r in runs.items()))


def per_row(w: LoraWeights, x, y, slots):
    out = y.clone().float()
    rank = w.a.shape[2]
    for t, s in enumerate(slots):
        if s < 0:
            continue
        start = 0
        for j, width in enumerate(w.splits):
            h = w.a[s, j].float() @ x[t].float()
            expand = w.b[s, j * rank : (j + 1) * rank, start : start + width].float().t()
            out[t, start : start + width] += expand @ h
            start += width
    return out


@pytest.mark.parametrize(("slots", "splits", "k", "rank"), CPU_CASES)
def test_the_reference_is_the_per_row_formula(slots, splits, k, rank):
    w, x, y, batch = make_case(slots, splits, k, rank, torch.float32)
    expected = per_row(w, x, y, slots)
    REF.lora_delta(y, x, w, batch)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def kernels():
    try:
        return cpu_kernels.load()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        skip_or_fail(f"the CPU kernels cannot be built here: {exc}")


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("slots", "splits", "k", "rank"), CPU_CASES)
def test_cpu_kernels_match_the_reference(kernels, isa, dtype, slots, splits, k, rank):
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    ops = CpuOps(isa, kernels)
    w, x, y, batch = make_case(slots, splits, k, rank, dtype)
    expected = y.clone()
    REF.lora_delta(expected, x, w, batch)
    ops.lora_delta(y, x, w, batch)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_cpu_kernels_split_over_threads_match_the_reference(kernels, isa):
    """Enough rows that the shrink and the expand both split over the thread pool."""
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    w, x, y, batch = make_case([t % 5 - 1 for t in range(150)], (300, 41, 39), 75, 6, torch.float32)
    expected = y.clone()
    REF.lora_delta(expected, x, w, batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        CpuOps(isa, kernels).lora_delta(y, x, w, batch)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


def test_cpu_kernels_refuse_a_mismatched_pool(kernels):
    ops = CpuOps("scalar", kernels)
    w, x, y, batch = make_case([0, 1], (8,), 16, 4, torch.float32)
    with pytest.raises(RuntimeError, match="lora_delta: x \\[T, 16\\] and y \\[T, 8\\] expected"):
        ops.lora_delta(y, x[:, :8], w, batch)


# ---- the CUDA kernels (kernels/lora.cu) on the CPU emulation ----------------------------------------------

EMU_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize(("slots", "splits", "k", "rank"), CASES)
def test_cuda_kernels_emulated_match_the_reference(launcher, dtype, slots, splits, k, rank):
    from conduit_engine.ops.cuda_ops import CudaOps

    ops = CudaOps(launcher)
    w, x, y, batch = make_case(slots, splits, k, rank, dtype)
    expected = y.float()
    REF.lora_delta(expected, x.float(), LoraWeights(w.a.float(), w.b.float(), w.splits), batch)
    ops.lora_delta(y, x, w, batch)
    tol = EMU_TOL[dtype]
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol * 4)


def test_cuda_kernels_on_a_strided_view_of_a_fused_projection(launcher):
    """y may be a column slice of a wider buffer (its row stride is the buffer's)."""
    from conduit_engine.ops.cuda_ops import CudaOps

    w, x, _, batch = make_case([0, -1, 1, 0], (12,), 20, 4, torch.float32)
    wide = torch.randn(4, 30)
    expected = wide.clone()
    REF.lora_delta(expected[:, 5:17], x, w, batch)
    CudaOps(launcher).lora_delta(wide[:, 5:17], x, w, batch)
    torch.testing.assert_close(wide, expected, rtol=1e-4, atol=1e-4)


def test_cuda_wrapper_names_the_bad_argument(launcher):
    from conduit_engine.ops.cuda_ops import CudaOps

    w, x, y, batch = make_case([0, 1], (8,), 16, 4, torch.float32)
    bad = LoraBatch(batch.row_slots.long(), batch.spans)
    with pytest.raises(ValueError, match="row_slots: expected a contiguous int32"):
        CudaOps(launcher).lora_delta(y, x, w, bad)
