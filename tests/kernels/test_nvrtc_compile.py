"""Every specialisation compiles with NVRTC exactly as CuPy's RawModule compiles it on a GPU machine:
same source text, same options (ops/cuda_ops.py), name expressions resolved to lowered names.

NVRTC compiles without a GPU. The library comes from the nvidia-cuda-nvrtc wheel or a CUDA toolkit; when
neither is installed the tests skip with the reason, and fail under CI=true.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

import pytest
import torch

from conduit_engine.ops.cuda_ops import nvrtc_options
from conduit_engine.ops.kernel_loader import KERNEL_SOURCES, all_specializations, compile_unit, kernels_dir
from tests.support.shared import skip_or_fail

pytestmark = pytest.mark.kernels

HEAD_DIMS = (8, 64, 128, 256)
ARCH = "sm_80"  # the oldest supported architecture: bf16 conversions need it


def _find_nvrtc() -> str | None:
    candidates = []
    for site in sys.path:
        candidates += glob.glob(os.path.join(site, "nvidia", "cu1*", "lib", "libnvrtc.so.*"))
        candidates += glob.glob(os.path.join(site, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*"))
    candidates += glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")
    found = ctypes.util.find_library("nvrtc")
    candidates += [found] if found else []
    candidates = [c for c in candidates if "builtins" not in c]
    return candidates[0] if candidates else None


@pytest.fixture(scope="module")
def nvrtc() -> ctypes.CDLL:
    path = _find_nvrtc()
    if path is None:
        skip_or_fail(
            "libnvrtc not found (install nvidia-cuda-nvrtc or a CUDA toolkit): the NVRTC checks cannot run"
        )
    lib = ctypes.CDLL(path)
    lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
    return lib


@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_nvrtc_compiles_every_specialisation(nvrtc, source):
    refs = [
        r
        for r in all_specializations([torch.float32, torch.float16, torch.bfloat16], HEAD_DIMS)
        if r.source == source
    ]
    assert refs, source
    prog = ctypes.c_void_p()
    assert (
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(prog), compile_unit(source).encode(), source.encode(), 0, None, None
        )
        == 0
    )
    try:
        for ref in refs:
            assert nvrtc.nvrtcAddNameExpression(prog, ref.name.encode()) == 0
        options = [o.encode() for o in (*nvrtc_options(), f"--gpu-architecture={ARCH}")]
        rc = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        assert rc == 0, text
        assert "warning" not in text.lower(), text
        for ref in refs:
            lowered = ctypes.c_char_p()
            assert nvrtc.nvrtcGetLoweredName(prog, ref.name.encode(), ctypes.byref(lowered)) == 0, ref
            assert lowered.value and lowered.value.startswith(b"_Z"), ref
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def test_kernel_sources_include_no_toolkit_headers():
    """NVRTC in a CuPy wheel install has no cuda_fp16.h / cuda_bf16.h / cuda_runtime.h to include."""
    kernels = kernels_dir()
    paths = [*kernels.glob("*.cu"), *kernels.glob("*.cuh")]
    assert len(paths) > len(KERNEL_SOURCES)  # every source, plus the shared headers
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith("#include"):
                assert '"' in line, f"{path.name}: {line} (only project headers may be included)"
