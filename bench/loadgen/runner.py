"""Drives a workload at a server: a fixed number of requests in flight, or Poisson arrivals at a rate."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.loadgen.client import RequestRecord, Target, send_request
from bench.loadgen.workload import RequestSpec


@dataclass(frozen=True)
class LoadPlan:
    """`concurrency`: N requests in flight at all times (closed loop). `rate`: Poisson arrivals at
    `value` requests/s (math.inf sends all at once), at most `max_concurrency` in flight if set."""

    mode: str
    value: float
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("concurrency", "rate"):
            raise ValueError(f"mode must be 'concurrency' or 'rate', got {self.mode!r}")
        if self.mode == "concurrency" and not (self.value >= 1 and float(self.value).is_integer()):
            raise ValueError(f"concurrency: must be an integer >= 1, got {self.value}")
        if self.mode == "rate" and not self.value > 0:
            raise ValueError(f"request rate: must be > 0 requests/s, got {self.value}")

    @property
    def in_flight_limit(self) -> int | None:
        return int(self.value) if self.mode == "concurrency" else self.max_concurrency

    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "concurrency" else f"rate={self.value:g}/s"


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of `n` requests whose gaps are exponential with mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate)
    return times


class _Progress:
    """A tqdm bar when asked for (imported only then: the test suite does not install tqdm)."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, unit="req", leave=False)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_load(
    target: Target,
    specs: Sequence[RequestSpec],
    plan: LoadPlan,
    seed: int = 0,
    progress: bool = False,
    timeout_s: float = 900.0,
) -> tuple[list[RequestRecord], float]:
    """Send every request of `specs` under `plan`; returns the records (in workload order) and the
    duration in seconds from the first send to the last answer."""
    arrivals = (
        [0.0] * len(specs) if plan.mode == "concurrency" else poisson_arrivals(len(specs), plan.value, seed)
    )
    limit = plan.in_flight_limit
    gate = asyncio.Semaphore(limit) if limit else None
    bar = _Progress(len(specs), f"{target.base_url} {plan.label()}", progress)
    pool = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=target.base_url, limits=pool, timeout=timeout) as client:
        started = time.perf_counter()

        async def one(spec: RequestSpec, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            if gate is not None:
                await gate.acquire()
            try:
                sent = time.perf_counter() - started
                record = await send_request(client, target, spec)
                record.start = sent
                return record
            finally:
                if gate is not None:
                    gate.release()
                bar.update()

        try:
            records = await asyncio.gather(*(one(s, at) for s, at in zip(specs, arrivals, strict=True)))
        finally:
            bar.close()
        return list(records), time.perf_counter() - started
