"""Builds and loads the CPU kernels of kernels/cpu/ as a torch extension, once per source version.

The extension is compiled by `torch.utils.cpp_extension` (g++ and ninja) into a folder named after a
digest of the sources, the torch version and the flags, inside the virtualenv (`<sys.prefix>/conduit-cpu-
kernels`, else `~/.cache/conduit/cpu-kernels` when the environment is read-only). `make venv` builds it
(`python -m conduit_engine.ops.cpu_kernels`); a later start only imports the built library, so a machine
(or image) without a compiler runs it too. Processes that start at once on a fresh checkout (tensor-
parallel workers, test servers) build it once between them: one compiles into a private folder under a
file lock and publishes it with a rename, the others wait and import it. When it cannot be built or
loaded, `CpuKernelsUnavailable` says why and the engine runs the torch ops instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from conduit_common.file_lock import exclusive_file_lock
from conduit_engine.ops.kernel_loader import kernels_dir

log = logging.getLogger(__name__)

SOURCES = (
    "bindings.cpp",
    "ops.cpp",
    "decoder.cpp",
    "lora.cpp",
    "parallel.cpp",
    "isa_avx512bf16.cpp",
    "isa_avx512.cpp",
    "isa_avx2.cpp",
    "isa_scalar.cpp",
)
# Instruction sets are chosen per file by `#pragma GCC target`, so the flags name none. The step's
# kernels split their calls on the library's own pool (parallel.cpp); the load-time packing uses
# at::parallel_for, ATen's header compiled here, which without -fopenmp runs its whole range on the
# calling thread. The library then needs libgomp.so.1, the one torch has loaded.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wall", "-Wno-unknown-pragmas")
LDFLAGS = ("-fopenmp",)
ISAS = ("avx512bf16", "avx512", "avx2", "scalar")  # best first


class CpuKernelsUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here; the message says why."""


def source_dir() -> Path:
    return kernels_dir() / "cpu"


def fingerprint() -> str:
    """Digest of everything the library depends on: its sources and headers, torch, the flags."""
    digest = hashlib.sha256(f"{torch.__version__} {' '.join(CFLAGS + LDFLAGS)}".encode())
    for path in sorted(source_dir().iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _build_roots() -> list[Path]:
    return [Path(sys.prefix) / "conduit-cpu-kernels", Path.home() / ".cache" / "conduit" / "cpu-kernels"]


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise CpuKernelsUnavailable(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _writable(root: Path) -> bool:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(root, os.W_OK)


def _build_lock(root: Path) -> contextlib.AbstractContextManager[None]:
    """One builder at a time per build folder, across processes (engines, tensor-parallel workers and
    test servers may all start on a fresh checkout at once); the others wait, then import its build."""
    return exclusive_file_lock(root / ".build.lock")


def _build(name: str, root: Path) -> ModuleType:
    """Build `name` into `root/name`: compiled in a private folder, then published by one rename, so
    another process never sees a half-written library; under `_build_lock`, so it is built once."""
    if shutil.which("g++") is None:
        raise CpuKernelsUnavailable("no C++ compiler (g++) to build kernels/cpu")
    with _build_lock(root):
        folder = root / name
        library = folder / f"{name}.so"
        if library.is_file():  # another process built it while this one waited
            return _import(name, library)
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            module = _compile(name, scratch)
            scratch.chmod(0o755)  # mkdtemp's 0700 would hide it from an image's non-root runtime user
            shutil.rmtree(folder, ignore_errors=True)  # what an interrupted build may have left
            os.rename(scratch, folder)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        for stale in root.glob("conduit_cpu_kernels_*"):  # builds of earlier sources
            if stale != folder:
                shutil.rmtree(stale, ignore_errors=True)
    return module


def _compile(name: str, folder: Path) -> ModuleType:
    from torch.utils import cpp_extension

    started = time.monotonic()
    log.info(
        "building the CPU kernels (kernels/cpu) for %s, once per version (about a minute)", folder.parent
    )
    path = os.environ.get("PATH", "")
    # ninja from the `ninja` wheel sits beside this interpreter, which may not be on PATH
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(source_dir() / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # compiler or ninja errors come as RuntimeError/CalledProcessError/OSError
        raise CpuKernelsUnavailable(f"building kernels/cpu failed: {str(exc).strip()[-2000:]}") from exc
    finally:
        os.environ["PATH"] = path
    log.info("built the CPU kernels in %.0f s", time.monotonic() - started)
    return module


@functools.cache
def load(build: bool = True) -> ModuleType:
    """The extension module (submodules avx512bf16, avx512, avx2, scalar; `supported_isas()`).

    Imports an existing build of these sources, else builds one when `build` (raises
    CpuKernelsUnavailable with the reason when neither works)."""
    try:
        name = f"conduit_cpu_kernels_{fingerprint()}"
    except OSError as exc:
        raise CpuKernelsUnavailable(f"kernels/cpu sources not found: {exc}") from exc
    for root in _build_roots():
        library = root / name / f"{name}.so"
        if library.is_file():
            try:
                return _import(name, library)
            except ImportError as exc:
                raise CpuKernelsUnavailable(f"cannot load {library}: {exc}") from exc
    if not build:
        raise CpuKernelsUnavailable("kernels/cpu is not built (run `make venv` or the engine once)")
    root = next((r for r in _build_roots() if _writable(r)), None)
    if root is None:
        raise CpuKernelsUnavailable(f"no writable folder to build kernels/cpu in ({_build_roots()})")
    return _build(name, root)


def supported_isas() -> tuple[str, ...]:
    """The instruction sets of ISAS that this CPU runs, best first (raises CpuKernelsUnavailable)."""
    return tuple(load().supported_isas())


def main() -> None:
    """`python -m conduit_engine.ops.cpu_kernels`: build (or find) the kernels and say which ISAs run."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        isas = supported_isas()
    except CpuKernelsUnavailable as exc:
        print(f"CPU kernels not built: {exc}; the engine will run the torch ops on the CPU")
        return
    print(f"CPU kernels ready ({load().__file__}); this CPU runs: {', '.join(isas)}")


if __name__ == "__main__":
    main()
