"""The CPU kernels' thread pool (kernels/cpu/parallel.cpp): a call split over the calling thread and the
pool's helpers gives the one-thread result bit for bit, at any thread count, and calls made at once
from several Python threads (the kernels release the GIL for large calls) each get their own result,
as the pool runs one call at a time and the others run on their callers' threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from conduit_engine.ops import cpu_kernels, quant
from conduit_engine.ops.cpu_ops import CpuOps
from tests.support.shared import skip_or_fail

pytestmark = pytest.mark.kernels

# big enough that every call is split (kernels/cpu/parallel.h kMinParallelWork): decode rows and a block
SHAPES = [(1, 4096, 768), (3, 2304, 768), (40, 1000, 256)]


@pytest.fixture
def ops() -> CpuOps:
    """A fresh CpuOps per test: it finds prepacked weights by address, and a test's weights die with it."""
    try:
        kernels = cpu_kernels.load()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        skip_or_fail(f"the CPU kernels cannot be built here: {exc}")
    return CpuOps(kernels.supported_isas()[0], kernels)


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _calls(ops: CpuOps) -> list[Callable[[], torch.Tensor]]:
    """int8 and float32 linears of SHAPES on prepacked weights (kept alive by the closures)."""
    calls = []
    g = torch.Generator().manual_seed(0)
    for m, n, k in SHAPES:
        weight = torch.randn(n, k, generator=g)
        q, scale = quant.quantize_weight(weight)
        ops.prepare_linear(weight)
        ops.prepare_linear(q, scale)
        x = torch.randn(m, k, generator=g)
        calls.append(lambda x=x, w=weight: ops.linear(x, w))
        calls.append(lambda x=x, q=q, s=scale: ops.linear(x, q, None, s))
    return calls


def test_split_calls_equal_the_one_thread_result_at_every_thread_count(ops: CpuOps, threads) -> None:
    calls = _calls(ops)
    threads(1)
    expected = [call() for call in calls]
    for count in (2, 3, 4):
        threads(count)
        for _ in range(20):  # helpers join late, early or not at all: every split must add up the same
            for call, want in zip(calls, expected, strict=True):
                assert torch.equal(call(), want)


def test_calls_from_several_threads_at_once_each_get_their_own_result(ops: CpuOps, threads) -> None:
    calls = _calls(ops)
    threads(1)
    expected = [call() for call in calls]
    threads(2)
    wrong: list[int] = []
    start = threading.Barrier(4)

    def worker(offset: int) -> None:
        start.wait()
        for i in range(120):
            j = (i + offset) % len(calls)
            if not torch.equal(calls[j](), expected[j]):
                wrong.append(j)

    workers = [threading.Thread(target=worker, args=(offset,)) for offset in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert wrong == []
