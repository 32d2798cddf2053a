"""bench/loadgen: percentile and goodput math, the result JSON round trip, the ratio table."""

from __future__ import annotations

import json
import math

import pytest

from bench.loadgen.client import RequestRecord, event_text
from bench.loadgen.metrics import Slo, percentile, summarize
from bench.loadgen.report import TableRow, format_ratio_table, format_run
from bench.loadgen.results import FORMAT, RunResult, append_result, dumps, read_results

pytestmark = pytest.mark.unit


def record(ttft, e2e, tokens, itl=(), ok=True, prompt=10):
    return RequestRecord(
        ok=ok,
        error=None if ok else "HTTP 503: busy",
        ttft=ttft,
        e2e=e2e,
        itl=list(itl),
        prompt_tokens=prompt if ok else None,
        output_tokens=tokens if ok else 0,
        usage_reported=ok,
        planned_prompt_tokens=prompt,
        planned_output_tokens=tokens,
    )


def test_percentile_interpolates_like_numpy():
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(values, 0) == 15.0
    assert percentile(values, 50) == 35.0
    assert percentile(values, 40) == 29.0  # rank 1.6: 20 + 0.6 * 15
    assert percentile(values, 90) == 46.0  # rank 3.6: 40 + 0.6 * 10
    assert percentile(values, 100) == 50.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in"):
        percentile(values, 101)


def test_tpot_excludes_the_first_token():
    assert record(0.1, 1.1, 11).tpot == pytest.approx(0.1)
    assert record(0.1, 0.1, 1).tpot is None
    assert record(0.1, 1.1, 11, ok=False).tpot is None


def test_summary_figures():
    records = [
        record(0.1, 1.1, 11, itl=[0.1] * 10),
        record(0.3, 2.3, 21, itl=[0.1] * 20),
        record(None, None, 0, ok=False),
    ]
    s = summarize(records, duration_s=4.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == ["HTTP 503: busy"]
    assert (s["prompt_tokens"], s["output_tokens"]) == (20, 32)
    assert s["output_tok_s"] == 8.0 and s["total_tok_s"] == 13.0 and s["request_throughput"] == 0.5
    assert s["ttft_ms"]["count"] == 2 and s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 30
    assert s["e2e_ms"]["p90"] == pytest.approx(2180.0)  # 1100 + 0.9 * 1200
    assert s["usage_reported"] is True and s["goodput"] is None


def test_goodput_counts_requests_that_meet_every_slo():
    records = [
        record(0.1, 1.1, 11),  # TTFT 100 ms, TPOT 100 ms
        record(0.5, 1.5, 11),  # TTFT 500 ms, TPOT 100 ms
        record(0.1, 3.1, 11),  # TTFT 100 ms, TPOT 300 ms
        record(0.1, 0.1, 1),  # one token: no TPOT, the TPOT objective does not apply
        record(None, None, 0, ok=False),
    ]
    s = summarize(records, 2.0, Slo(ttft_ms=200, tpot_ms=150))
    assert s["goodput"] == {
        "slo": {"ttft_ms": 200, "tpot_ms": 150, "e2e_ms": None},
        "good_requests": 2,
        "good_fraction": 0.4,
        "request_throughput": 1.0,
    }
    assert summarize(records, 2.0, Slo(e2e_ms=1500))["goodput"]["good_requests"] == 3
    assert summarize(records, 2.0, Slo())["goodput"] is None


def test_event_text_reads_both_endpoints():
    assert event_text({"choices": [{"index": 0, "text": "ab"}]}) == "ab"
    assert event_text({"choices": [{"index": 0, "delta": {"content": "c"}}]}) == "c"
    assert event_text({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) == ""
    assert event_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_result_json_round_trip(tmp_path):
    records = [record(0.1, 1.1, 11, itl=[0.1] * 10), record(None, None, 0, ok=False)]
    meta = {"label": "x", "load": "rate=inf/s", "endpoint": "completions", "mode": "rate", "value": math.inf}
    result = RunResult(meta=meta, summary=summarize(records, 2.0), records=records)
    line = dumps(result)
    data = json.loads(line)  # strict JSON: NaN and infinity are written as null and "inf"
    assert data["format"] == FORMAT and data["meta"]["value"] == "inf"
    assert data["summary"]["tpot_ms"]["count"] == 1
    assert data["records"][1]["error"] == "HTTP 503: busy"
    path = tmp_path / "runs.jsonl"
    append_result(path, result)
    append_result(path, result)
    back = read_results(path)
    assert len(back) == 2 and back[0].records == records and back[0].summary["output_tokens"] == 11
    with pytest.raises(ValueError, match="format: expected"):
        RunResult.from_dict({"format": "other"})
    assert "rate=inf/s" in format_run(back[0]) and "error: HTTP 503: busy" in format_run(back[0])


def test_ratio_table():
    rows = [
        TableRow("134M", 1, {"conduit": 31.0, "llama.cpp": 120.0, "vllm": 62.0}),
        TableRow("stories260K", 64, {"conduit": 4747.0, "llama.cpp": 2779.0, "vllm": None}),
    ]
    table = format_ratio_table(rows, ["conduit", "llama.cpp", "vllm"])
    assert table.splitlines() == [
        "| model, concurrency | conduit | llama.cpp | vllm | conduit ÷ llama.cpp | conduit ÷ vllm |",
        "|---|---|---|---|---|---|",
        "| 134M, c=1 | 31 | 120 | 62 | 0.26 | 0.50 |",
        "| stories260K, c=64 | 4,747 | 2,779 | – | 1.71 | – |",
    ]
