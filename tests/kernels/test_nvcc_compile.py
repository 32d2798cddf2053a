"""Every kernels/*.cu compiles with nvcc for sm_80 and sm_90 without warnings or register spills.

Each source is compiled with all the specialisations the CUDA ops can launch (dtypes x head sizes),
with `-Xptxas -v`; registers, shared memory and stack per kernel are printed and written to
build/kernel-resources-<arch>.txt. Without nvcc the tests skip with the reason, and fail under CI=true.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conduit_engine.ops.kernel_loader import KERNEL_SOURCES, all_specializations, kernels_dir
from tests.support.shared import require_executable

pytestmark = pytest.mark.kernels

ARCHS = ("sm_80", "sm_90")
HEAD_DIMS = (8, 64, 128, 256)  # the prefill kernel is templated on head_dim
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BUILD = Path(__file__).resolve().parents[2] / "build"

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def _instantiation_unit(source: str) -> str:
    """The source plus a table of pointers to each specialisation, which makes nvcc emit all of them."""
    refs = [ref for ref in all_specializations(DTYPES, HEAD_DIMS) if ref.source == source]
    table = ", ".join(f"reinterpret_cast<const void*>(&{ref.name})" for ref in refs)
    name = "conduit_instances_" + source.replace(".", "_")
    declare = f"extern const void* const {name}[];"
    return f'#include "{source}"\n{declare}\nconst void* const {name}[] = {{{table}}};\n'


def _compile(source: str, arch: str, workdir: Path) -> tuple[str, str, str]:
    unit = workdir / f"{source}.{arch}.instances.cu"
    unit.write_text(_instantiation_unit(source))
    cmd = [
        "nvcc",
        "-std=c++17",
        "-cubin",
        f"-arch={arch}",
        "-Xptxas",
        "-v",
        "-Xptxas",
        "-warn-spills",
        "-Xptxas",
        "-warn-lmem-usage",
        f"-I{kernels_dir()}",
        str(unit),
        "-o",
        str(workdir / f"{source}.{arch}.cubin"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    return (
        source,
        arch,
        result.stdout + result.stderr + ("" if result.returncode == 0 else f"\nexit {result.returncode}"),
    )


def _demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("cu++filt") or shutil.which("c++filt")
    if filt is None:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return {n: re.sub(r"\(.*", "", d) for n, d in zip(names, out, strict=False)}


def _resources(log: str) -> list[dict]:
    rows, current = [], None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = {"kernel": m.group(1), "arch": m.group(2)}
            rows.append(current)
        elif current is not None and (m := _PROPS.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            current.update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return rows


@pytest.fixture(scope="module")
def compile_logs(tmp_path_factory) -> dict[tuple[str, str], str]:
    require_executable("nvcc", "the CUDA compile checks cannot run on this machine")
    workdir = tmp_path_factory.mktemp("nvcc")
    jobs = [(source, arch) for source in KERNEL_SOURCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: _compile(*job, workdir), jobs))
    return {(source, arch): log for source, arch, log in results}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_compiles_without_warnings_or_spills(compile_logs, source, arch):
    log = compile_logs[(source, arch)]
    assert "exit " not in log and "error" not in log.lower(), log
    assert "warning" not in log.lower(), log
    rows = _resources(log)
    expected = sum(1 for ref in all_specializations(DTYPES, HEAD_DIMS) if ref.source == source)
    assert len(rows) == expected, (
        f"expected {expected} kernels in {source}, ptxas reported {len(rows)}:\n{log}"
    )
    for row in rows:
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, f"register spills in {row}"


def test_records_registers_and_shared_memory(compile_logs, capsys):
    BUILD.mkdir(exist_ok=True)
    for arch in ARCHS:
        rows = [row for source in KERNEL_SOURCES for row in _resources(compile_logs[(source, arch)])]
        names = _demangle([row["kernel"] for row in rows])
        lines = [f"{'kernel':<72} {'regs':>5} {'smem':>6} {'stack':>6}"]
        lines += [
            f"{names[r['kernel']][:72]:<72} {r['registers']:>5} {r['smem']:>6} {r['stack']:>6}" for r in rows
        ]
        table = "\n".join(lines)
        (BUILD / f"kernel-resources-{arch}.txt").write_text(table + "\n")
        with capsys.disabled():
            print(f"\nptxas resources for {arch} (static smem; dynamic smem is sized at launch):\n{table}")
        assert all(r["registers"] <= 255 for r in rows)
