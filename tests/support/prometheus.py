"""Scraping a real /metrics endpoint and reading its samples by name and labels."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scrape", "scrape"]


@dataclass(frozen=True)
class Scrape:
    """Every sample of one scrape: (sample name, sorted label pairs) → value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @property
    def names(self) -> set[str]:
        """The sample names exported (`_bucket`, `_sum`, `_count`, `_total` included)."""
        return {name for name, _ in self.samples}

    def value(self, name: str, **labels: str) -> float:
        """The one sample `name` whose labels include `labels`; AssertionError unless exactly one."""
        wanted = set(labels.items())
        found = [v for (n, pairs), v in self.samples.items() if n == name and wanted <= set(pairs)]
        assert len(found) == 1, f"{len(found)} samples of {name}{labels}"
        return found[0]

    def labels(self, name: str) -> list[dict[str, str]]:
        """The label sets of every sample named `name`."""
        return [dict(pairs) for n, pairs in self.samples if n == name]


def scrape(url: str, timeout_s: float = 10.0) -> Scrape:
    """GET `url` (a /metrics endpoint) and parse the Prometheus text it answers (raises on non-200)."""
    response = httpx.get(url, timeout=timeout_s)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Scrape(samples)
