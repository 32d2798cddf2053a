"""Fixtures of the kernel tests: one emulation library per session (cached across sessions on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_emulator import FORWARD, EmulatedLauncher, build_library, repo_build_dir

from conduit_engine.ops.kernel_loader import KernelRef, all_specializations
from tests.support.shared import require_executable

HERE = Path(__file__).resolve().parent
SELFTEST_SOURCE = HERE / "emu_selftest.cu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (8, 64, 128, 256)  # stories260K has head_dim 8; 64, 128 and 256 (Gemma) the real sizes
SELFTEST_KERNELS = tuple(
    KernelRef("emu_selftest.cu", name)
    for name in (
        "selftest_block_sum",
        "selftest_warp_ops",
        "selftest_rotate",
        "selftest_rotate_dynamic",
        "selftest_bad_sync",
        "selftest_convert",
        "selftest_atomics",
        "selftest_smem_overflow",
        "selftest_mma",
    )
)


@pytest.fixture(scope="session")
def emu_build() -> tuple[Path, dict[KernelRef, str]]:
    require_executable("g++", "the CUDA kernels cannot be emulated on this machine")
    refs = [*all_specializations(DTYPES, HEAD_DIMS), *SELFTEST_KERNELS]
    return build_library(refs, repo_build_dir(), extra_sources=[SELFTEST_SOURCE])


@pytest.fixture
def launcher(emu_build) -> EmulatedLauncher:
    library, symbols = emu_build
    return EmulatedLauncher(library, symbols, schedule=FORWARD)
