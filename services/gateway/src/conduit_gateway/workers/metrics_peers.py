"""/metrics across workers: the worker a scrape reaches asks its siblings for their metrics over Unix
sockets in the supervisor's directory and answers the sum.

Each worker keeps its own registry (the metrics code does not change with --workers). Counters and
histograms add up; gauges add up too (requests in flight), except those every worker measures of the
same thing (an engine's health, its KV index), where the sum would count it N times: those take the
largest. A worker that does not answer (one being restarted) is left out; its counters start again
from zero when it is back, which Prometheus reads as a counter reset of the sum.
`conduit_gateway_workers` says how many workers the answer covers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from conduit_gateway.workers.slot import WorkerSlot

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0

# Gauges each worker reports of one shared thing: the largest, not the sum.
MAX_GAUGES = frozenset(
    {
        "conduit_gateway_engine_up",
        "conduit_gateway_node_routable",
        "conduit_gateway_kv_index_blocks",
        "conduit_gateway_kv_index_current",
        "conduit_gateway_kv_event_lag_seconds",
    }
)


class MetricsPeers:
    """Worker `slot.index`'s side: serve `render()` to the siblings, and merge theirs into a scrape."""

    def __init__(self, slot: WorkerSlot, render: Callable[[], bytes]) -> None:
        self.slot = slot
        self._render = render
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        path = self.slot.metrics_socket(self.slot.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a predecessor's
        self._server = await asyncio.start_unix_server(self._answer, path=path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(self._render())
            await writer.drain()
        finally:
            writer.close()

    async def _scrape(self, index: int) -> bytes | None:
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(self.slot.metrics_socket(index))
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            log.warning("metrics: worker %d did not answer (%s); left out of this scrape", index, exc)
            return None

    async def render(self) -> bytes:
        others = [i for i in range(self.slot.count) if i != self.slot.index]
        texts = [self._render(), *await asyncio.gather(*(self._scrape(i) for i in others))]
        return merge_expositions([text.decode() for text in texts if text is not None])


def merge_expositions(texts: Iterable[str]) -> bytes:
    """Prometheus text expositions of the workers, as one (see the module docstring for the rules)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    count = 0
    for text in texts:
        count += 1
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            merged = values[family.name]
            combine = _combiner(family)
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                merged[key] = sample.value if key not in merged else combine(merged[key], sample.value)
    for name, family in families.items():
        family.samples = [
            Sample(sample, dict(labels), value) for (sample, labels), value in values[name].items()
        ]
    workers = GaugeMetricFamily("conduit_gateway_workers", "Gateway workers whose metrics this scrape sums.")
    workers.add_metric([], count)
    registry = CollectorRegistry()
    registry.register(_Families([*families.values(), workers]))
    return generate_latest(registry)


def _combiner(family: Metric) -> Callable[[float, float], float]:
    if family.name.endswith("_created"):
        return min  # when the series began: the earliest worker's
    if family.type == "gauge" and family.name in MAX_GAUGES:
        return max
    return lambda a, b: a + b


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
