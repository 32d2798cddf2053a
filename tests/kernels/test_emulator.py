"""Self-tests of the CUDA emulation harness: it must compute what a GPU computes and expose barrier bugs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SELFTEST_KERNELS
from kernel_emulator import FORWARD, REVERSE, SHUFFLED, EmulatedLauncher, EmulationError

pytestmark = pytest.mark.kernels

BLOCK_SUM, WARP_OPS, ROTATE, ROTATE_DYNAMIC, BAD_SYNC, CONVERT, ATOMICS, SMEM_OVERFLOW, MMA = SELFTEST_KERNELS


def _launcher(emu_build, schedule=FORWARD) -> EmulatedLauncher:
    library, symbols = emu_build
    return EmulatedLauncher(library, symbols, schedule=schedule, seed=3)


@pytest.mark.parametrize("threads", [32, 96, 1024])
def test_block_reduction_sums_exactly(emu_build, threads):
    x = torch.arange(1, 3001, dtype=torch.float32)  # integers: every summation order is exact
    out = torch.zeros(3)
    _launcher(emu_build).launch(BLOCK_SUM, (3, 1, 1), (threads, 1, 1), [out, x, np.int32(3000)])
    assert out.tolist() == [4501500.0] * 3


@pytest.mark.parametrize("offset", [1, 5, 16])
def test_warp_shuffles_and_votes_follow_cuda_semantics(emu_build, offset):
    threads = 64
    out = torch.zeros(threads * 8, dtype=torch.int32)
    _launcher(emu_build, SHUFFLED).launch(WARP_OPS, (1, 1, 1), (threads, 1, 1), [out, np.int32(offset)])
    got = out.view(threads, 8).tolist()
    ballot = sum(1 << lane for lane in range(32) if lane % 3 == 0)
    ballot = ballot - (1 << 32) if ballot >= 1 << 31 else ballot  # int32 view of the mask
    for tid in range(threads):
        lane, base = tid % 32, tid - tid % 32
        up = tid - offset if lane >= offset else tid
        down = tid + offset if lane + offset < 32 else tid
        xor = base + (lane ^ offset)
        any_all = (1 if base == 0 else 0) + 2  # tid 5 is in warp 0 only; lane < 32 always holds
        half_down = (tid + 1 if lane + 1 < 16 else tid) if lane < 16 else -1
        assert got[tid] == [
            (base + (lane + offset) % 32) * 10,
            xor * 10,
            up * 10,
            down * 10,
            (base + (lane ^ 1)) * 10,
            ballot,
            any_all,
            half_down,
        ], f"thread {tid}"


@pytest.mark.parametrize("kernel", [ROTATE, ROTATE_DYNAMIC], ids=["static", "dynamic"])
def test_missing_syncthreads_is_exposed(emu_build, kernel):
    threads = 256
    x = torch.arange(threads, dtype=torch.float32)
    want = torch.roll(x, -1)
    smem = threads * 4 if kernel is ROTATE_DYNAMIC else 0
    for schedule in (FORWARD, REVERSE, SHUFFLED):
        launcher = _launcher(emu_build, schedule)
        out = torch.zeros(threads)
        launcher.launch(kernel, (1, 1, 1), (threads, 1, 1), [out, x, np.int32(1)], smem)
        assert torch.equal(out, want)  # with the barrier: correct in every order
        # Without it: wrong in every order, also right after a correct run left the right values in
        # shared memory (the harness poisons shared memory before each block).
        for _ in range(2):
            launcher.launch(kernel, (1, 1, 1), (threads, 1, 1), [out, x, np.int32(0)], smem)
            assert not torch.equal(out, want)
            assert torch.isnan(out).any()  # poisoned shared memory reads as NaN


def test_static_shared_variables_are_found_and_poisoned(emu_build):
    launcher = _launcher(emu_build)
    # scratch of the block reductions, the norms, the sampling kernel and the self-tests
    assert launcher.static_shared_regions >= 6


@pytest.mark.parametrize(
    "mode,message",
    [(0, "divergent __syncthreads"), (1, "after 16 threads of the block exited"), (2, "deadlock")],
    ids=["divergent", "exited", "warp-deadlock"],
)
def test_barrier_misuse_is_reported(emu_build, mode, message):
    out = torch.zeros(32)
    with pytest.raises(EmulationError, match=message):
        _launcher(emu_build).launch(BAD_SYNC, (1, 1, 1), (32, 1, 1), [out, np.int32(mode)])
    # the harness recovers: the next launch runs normally
    x = torch.ones(64)
    total = torch.zeros(1)
    _launcher(emu_build).launch(BLOCK_SUM, (1, 1, 1), (64, 1, 1), [total, x, np.int32(64)])
    assert total.item() == 64.0


def test_arguments_are_checked_against_the_kernel_signature(emu_build):
    launcher = _launcher(emu_build)
    x = torch.ones(8)
    out = torch.zeros(1)
    with pytest.raises(TypeError, match="expects i4, got int64"):
        launcher.launch(BLOCK_SUM, (1, 1, 1), (32, 1, 1), [out, x, np.int64(8)])
    with pytest.raises(TypeError, match="expects p4, got a torch.float16 tensor"):
        launcher.launch(BLOCK_SUM, (1, 1, 1), (32, 1, 1), [out, x.half(), np.int32(8)])
    with pytest.raises(TypeError, match="2 arguments for 3 parameters"):
        launcher.launch(BLOCK_SUM, (1, 1, 1), (32, 1, 1), [out, x])
    with pytest.raises(ValueError, match="more than 1024 threads"):
        launcher.launch(BLOCK_SUM, (1, 1, 1), (64, 32, 1), [out, x, np.int32(8)])


def test_half_and_bfloat16_conversions_round_like_torch(emu_build):
    """Emulated __float2half_rn / __float2bfloat16_rn round to nearest even like torch, subnormals and
    overflow included, and converting back is exact."""
    x = torch.cat(
        [
            torch.randn(4000, generator=torch.Generator().manual_seed(1)) * 1000,
            torch.randn(2000, generator=torch.Generator().manual_seed(2)) * 1e-6,  # half subnormals
            torch.tensor(
                [
                    0.0,
                    -0.0,
                    65504.0,
                    65519.0,
                    65520.0,
                    1e6,
                    float("inf"),
                    -float("inf"),
                    2.0**-24,
                    2.0**-25,
                    3 * 2.0**-26,
                    1.0 + 2.0**-11,
                    1.0 + 3 * 2.0**-11,
                    3.0e38,
                ]
            ),
        ]
    )
    n = x.numel()
    half, bf16 = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
    back_half, back_bf16 = torch.empty(n), torch.empty(n)
    _launcher(emu_build).launch(
        CONVERT, (4, 1, 1), (256, 1, 1), [half, bf16, back_half, back_bf16, x, np.int32(n)]
    )
    assert torch.equal(half.view(torch.int16), x.to(torch.float16).view(torch.int16))
    assert torch.equal(bf16.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(back_half, half.float()) and torch.equal(back_bf16, bf16.float())


def test_atomics_from_all_threads(emu_build):
    counter, total = torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    maximum, claimed = torch.full((1,), -5, dtype=torch.int32), torch.full((3,), -1, dtype=torch.int32)
    _launcher(emu_build, SHUFFLED).launch(ATOMICS, (3, 1, 1), (64, 1, 1), [counter, total, maximum, claimed])
    assert counter.item() == 192
    assert total.item() == sum(range(192))
    assert maximum.item() == max(g * 7 % 1000 for g in range(192))
    # exactly one thread of each block claims its slot, and it is a thread of that block
    assert [c // 64 for c in claimed.tolist()] == [0, 1, 2]


def test_writes_past_dynamic_shared_memory_are_reported(emu_build):
    launcher = _launcher(emu_build)
    launcher.launch(SMEM_OVERFLOW, (2, 1, 1), (64, 1, 1), [np.int32(0)], 64 * 4)  # in bounds
    with pytest.raises(EmulationError, match="wrote past the 256 bytes of dynamic shared memory"):
        launcher.launch(SMEM_OVERFLOW, (2, 1, 1), (64, 1, 1), [np.int32(1)], 64 * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_tensor_core_mma_follows_the_ptx_fragment_layout(emu_build, dtype):
    """D = A B + C for mma.m16n8k16 with fragments loaded and stored as kernels/mma.cuh documents them
    (small integers: every product and sum is exact, so the result must equal the matmul exactly)."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(-8, 9, (16, 16), generator=gen).to(dtype)
    b = torch.randint(-8, 9, (16, 8), generator=gen).to(dtype)
    c = torch.randint(-50, 51, (16, 8), generator=gen).float()
    d = c.clone()
    args = [d, a.view(torch.int16), b.t().contiguous().view(torch.int16), np.int32(dtype == torch.bfloat16)]
    _launcher(emu_build, SHUFFLED).launch(MMA, (1, 1, 1), (32, 1, 1), [*args, np.int32(32)])
    assert torch.equal(d, a.float() @ b.float() + c)


def test_tensor_core_mma_needs_the_whole_warp(emu_build):
    d = torch.zeros(16, 8)
    a = torch.zeros(16, 16, dtype=torch.int16)
    b_t = torch.zeros(8, 16, dtype=torch.int16)
    with pytest.raises(EmulationError, match="deadlock: .* 16 at warp operations, 16 exited"):
        _launcher(emu_build).launch(MMA, (1, 1, 1), (32, 1, 1), [d, a, b_t, np.int32(1), np.int32(16)])
