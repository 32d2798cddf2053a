"""CPU execution of kernels/*.cu: builds them with g++ against kernels/emulation/cuda_emu.h and launches
them through ctypes on CPU tensors, behind the same launcher protocol CudaOps uses with CuPy.

One shared library holds every requested specialisation; it is cached under build/kernel-emu/<hash>/ by
the hash of the sources, the specialisation list and the compiler flags, so a test session compiles at
most once. Each launch checks the arguments against the kernel's real C++ signature (pointer element
sizes, integer and float widths), so a wrapper that passes the wrong type fails here, not on a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from conduit_engine.ops.kernel_loader import KERNEL_SOURCES, KernelArg, KernelRef, kernels_dir

FORWARD, REVERSE, SHUFFLED = 0, 1, 2
_CXXFLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    # The GPU contracts a*b+c into FMA; plain C++ keeps them separate. Tests compare with tolerances that
    # cover both; keeping g++ from contracting makes the emulation deterministic across CPUs.
    "-ffp-contract=off",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-Werror",
)
# Function-local statics of the toolchain and of the emulator itself are not __shared__ variables.
_NOT_SHARED = ("_ZZNSt", "_ZZSt", "_ZZN9__gnu", "_ZZN3emu", "_ZZN10__cxxabi")


class LaunchConfig(ctypes.Structure):
    _fields_ = (
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint64),
        ("schedule", ctypes.c_int),
        ("seed", ctypes.c_uint64),
    )


class EmulationError(RuntimeError):
    """The emulator aborted a launch (divergent barrier, deadlock, barrier after exit, bad config)."""


def build_library(
    refs: Sequence[KernelRef], build_root: Path, extra_sources: Sequence[Path] = ()
) -> tuple[Path, dict[KernelRef, str]]:
    """Compile `refs` into one shared library (cached); returns its path and each ref's symbol.

    Refs name files of kernels/ or, for test-only kernels, the name of one of `extra_sources`."""
    refs = list(dict.fromkeys(refs))
    symbols = {ref: f"conduit_k{i}" for i, ref in enumerate(refs)}
    src_dir = kernels_dir()
    lines = ['#include "cuda_emu.h"']
    lines += [f'#include "{source}"' for source in KERNEL_SOURCES]
    lines += [f'#include "{path.resolve()}"' for path in extra_sources]
    lines += [f"CONDUIT_EMU_EXPORT({symbols[ref]}, ({ref.name}))" for ref in refs]
    unit = "\n".join(lines) + "\n"
    digest = hashlib.sha256(unit.encode())
    digest.update(" ".join(_CXXFLAGS).encode())
    sources = [*src_dir.glob("*.cu"), *src_dir.glob("*.cuh"), *src_dir.glob("emulation/*.h"), *extra_sources]
    for path in sorted(sources):
        digest.update(path.name.encode() + path.read_bytes())
    out_dir = build_root / digest.hexdigest()[:16]
    library = out_dir / "libconduit_emu.so"
    if not library.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            tu = Path(tmp) / "kernels_emu.cpp"
            tu.write_text(unit)
            target = Path(tmp) / library.name
            cmd = [
                "g++",
                *_CXXFLAGS,
                f"-I{src_dir}",
                f"-I{src_dir / 'emulation'}",
                str(tu),
                "-o",
                str(target),
            ]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{result.stderr}")
            os.replace(target, library)  # atomic: a concurrent session never loads a half-written file
    return library, symbols


def _static_shared_regions(library: Path, lib: ctypes.CDLL) -> list[tuple[int, int]]:
    """Addresses and sizes of the kernels' static __shared__ variables (function-local statics)."""
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError("nm (binutils) is needed to find the kernels' __shared__ variables")
    listing = subprocess.run(
        [nm, "-S", "--defined-only", str(library)], capture_output=True, text=True, check=True
    )
    values: dict[str, tuple[int, int, str]] = {}
    for line in listing.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4:
            values[parts[3]] = (int(parts[0], 16), int(parts[1], 16), parts[2])
    anchor = ctypes.cast(lib.conduit_emu_last_error, ctypes.c_void_p).value
    base = anchor - values["conduit_emu_last_error"][0]
    regions = []
    for name, (value, size, kind) in values.items():
        if name.startswith("_ZZ") and not name.startswith(_NOT_SHARED) and kind in "bBdDuV":
            regions.append((base + value, size))
    return regions


class EmulatedLauncher:
    """A `KernelLauncher` that runs the kernels on the CPU (see kernels/emulation/cuda_emu.h)."""

    def __init__(self, library: Path, symbols: dict[KernelRef, str], schedule: int = FORWARD, seed: int = 0):
        self._lib = ctypes.CDLL(str(library))
        self._lib.conduit_emu_last_error.restype = ctypes.c_char_p
        self._lib.conduit_emu_switch_count.restype = ctypes.c_ulonglong
        self._symbols = symbols
        self.schedule = schedule
        self.seed = seed
        self.launches: list[KernelRef] = []
        self.grids: list[tuple[int, int, int]] = []  # the grid of each launch, in order
        regions = _static_shared_regions(library, self._lib)
        addresses = (ctypes.c_void_p * max(1, len(regions)))(*[a for a, _ in regions])
        sizes = (ctypes.c_ulonglong * max(1, len(regions)))(*[s for _, s in regions])
        self._lib.conduit_emu_set_static_shared(addresses, sizes, len(regions))
        self.static_shared_regions = len(regions)

    def signature(self, kernel: KernelRef) -> list[str]:
        buf = ctypes.create_string_buffer(1024)
        getattr(self._lib, self._symbols[kernel] + "_signature")(buf, len(buf))
        return buf.value.decode().split(",") if buf.value else []

    @property
    def switch_count(self) -> int:
        return int(self._lib.conduit_emu_switch_count())

    def launch(
        self,
        kernel: KernelRef,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        shared_mem: int = 0,
    ) -> None:
        if kernel not in self._symbols:
            raise KeyError(f"{kernel} was not built into the emulation library")
        _check_launch_config(grid, block, shared_mem)
        expected = self.signature(kernel)
        if len(expected) != len(args):
            raise TypeError(f"{kernel.name}: {len(args)} arguments for {len(expected)} parameters")
        values = [
            _to_ctype(kernel, i, code, arg) for i, (code, arg) in enumerate(zip(expected, args, strict=True))
        ]
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        cfg = LaunchConfig(
            (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem, self.schedule, self.seed
        )
        self.launches.append(kernel)
        self.grids.append(tuple(grid))  # type: ignore[arg-type]
        rc = getattr(self._lib, self._symbols[kernel])(ctypes.byref(cfg), pointers)
        if rc != 0:
            raise EmulationError(f"{kernel.name}: {self._lib.conduit_emu_last_error().decode()}")


def _check_launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int) -> None:
    """The launch limits a CUDA device enforces, so a wrapper cannot pass here and fail on a GPU."""
    if len(grid) != 3 or len(block) != 3:
        raise ValueError(f"grid {grid} and block {block} must have 3 dimensions")
    if not (0 < grid[0] < 2**31 and 0 < grid[1] <= 65535 and 0 < grid[2] <= 65535):
        raise ValueError(f"grid {grid} outside CUDA limits")
    if not (0 < block[0] <= 1024 and 0 < block[1] <= 1024 and 0 < block[2] <= 64):
        raise ValueError(f"block {block} outside CUDA limits")
    if block[0] * block[1] * block[2] > 1024:
        raise ValueError(f"block {block} has more than 1024 threads")
    if shared_mem > 227 * 1024:
        raise ValueError(f"{shared_mem} bytes of dynamic shared memory exceed the 227 KiB of sm_90")


_SCALARS = {
    np.int32: ("i4", ctypes.c_int32),
    np.int64: ("i8", ctypes.c_int64),
    np.float32: ("f4", ctypes.c_float),
}


def _to_ctype(kernel: KernelRef, index: int, code: str, arg: KernelArg) -> ctypes._SimpleCData:
    where = f"{kernel.name} parameter {index}"
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cpu":
            raise ValueError(f"{where}: the emulator runs on CPU tensors, got {arg.device}")
        if code != f"p{arg.element_size()}":
            raise TypeError(f"{where}: kernel expects {code}, got a {arg.dtype} tensor")
        return ctypes.c_void_p(arg.data_ptr())
    if arg is None:
        if not code.startswith("p"):
            raise TypeError(f"{where}: kernel expects {code}, got a null pointer")
        return ctypes.c_void_p(None)
    for scalar_type, (scalar_code, ctype) in _SCALARS.items():
        if type(arg) is scalar_type:
            if code != scalar_code:
                raise TypeError(f"{where}: kernel expects {code}, got {scalar_type.__name__}")
            return ctype(arg.item())
    raise TypeError(
        f"{where}: unsupported argument {type(arg).__name__} (use a tensor or np.int32/int64/float32)"
    )


def repo_build_dir() -> Path:
    """build/kernel-emu at the repository root (gitignored)."""
    return Path(__file__).resolve().parents[2] / "build" / "kernel-emu"
