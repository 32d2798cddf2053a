"""The result of one run as JSON: what was run (meta), its summary, and every request's timings.

Results are stored as JSON Lines, one run per line, appended: a sweep or a peer comparison fills one
file that bench/plot.py reads back. `FORMAT` changes when a field changes meaning.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from bench.loadgen.client import RequestRecord

FORMAT = "conduit-bench-serving/1"
_RECORD_FIELDS = {f.name for f in fields(RequestRecord)}


@dataclass
class RunResult:
    """meta: label, server, model, endpoint, load plan, workload; summary: see metrics.summarize."""

    meta: dict[str, Any]
    summary: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "meta": self.meta,
            "summary": self.summary,
            "records": [asdict(r) for r in self.records],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        if data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {data.get('format')!r}")
        records = [
            RequestRecord(**{k: v for k, v in r.items() if k in _RECORD_FIELDS}) for r in data["records"]
        ]
        return cls(meta=data["meta"], summary=data["summary"], records=records)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null (an empty percentile) or the string 'inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def dumps(result: RunResult) -> str:
    return json.dumps(_finite(result.to_dict()), allow_nan=False, separators=(",", ":"))


def append_result(path: Path, result: RunResult) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(dumps(result) + "\n")


def read_results(path: Path) -> list[RunResult]:
    """Every run of a JSON Lines file (a file holding a single JSON object also works)."""
    text = path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        documents = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        documents = [json.loads(text)]
    return [RunResult.from_dict(d) for d in documents]
