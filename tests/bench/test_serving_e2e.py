"""bench/serving.py against a real Conduit stack (engine + gateway processes) on stories260K."""

from __future__ import annotations

import pytest

from bench.loadgen.client import Target
from bench.loadgen.metrics import Slo
from bench.loadgen.results import append_result, read_results
from bench.loadgen.runner import LoadPlan
from bench.loadgen.workload import LengthDist
from bench.serving import SweepConfig, build_parser, config_from_args, discover_model, run_sweep
from tests.support.processes import start_engine, start_gateway

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway_url(stories_path):
    with start_engine(stories_path) as engine, start_gateway(engine.address) as gateway:
        yield gateway.url


def sweep(url, stories_path, **overrides):
    config = SweepConfig(
        target=Target(base_url=url, model=overrides.pop("model", "stories260K"), endpoint="completions"),
        plans=[LoadPlan("concurrency", 2), LoadPlan("rate", float("inf"), max_concurrency=3)],
        num_requests=4,
        prompt_len=LengthDist.parse("uniform:8,24"),
        output_len=LengthDist.parse("uniform:5,9"),
        tokenizer=stories_path,
        seed=1,
        warmup=1,
        slo=Slo(ttft_ms=60_000),
        label="conduit",
        progress=False,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return run_sweep(config)


def test_sweep_counts_every_token_the_server_sent(gateway_url, stories_path, tmp_path):
    assert discover_model(gateway_url) == "stories260K"
    results = sweep(gateway_url, stories_path)
    assert [r.meta["load"] for r in results] == ["c=2", "rate=inf/s"]
    first = results[0]
    planned_out = [r.planned_output_tokens for r in first.records]
    for result in results:
        s = result.summary
        assert (s["completed"], s["failed"], s["usage_reported"]) == (4, 0, True)
        # ignore_eos: every request gets exactly its max_tokens, and the server counts the prompt as we did
        assert [r.output_tokens for r in result.records] == planned_out
        assert [r.prompt_tokens for r in result.records] == [r.planned_prompt_tokens for r in result.records]
        assert s["output_tokens"] == sum(planned_out)
        assert all(r.ttft is not None and r.e2e >= r.ttft for r in result.records)
        assert all(len(r.itl) <= r.output_tokens - 1 for r in result.records)
        assert s["goodput"]["good_requests"] == 4
    path = tmp_path / "runs.jsonl"
    for result in results:
        append_result(path, result)
    assert [r.records for r in read_results(path)] == [r.records for r in results]


def test_chat_endpoint(gateway_url, stories_path):
    args = build_parser().parse_args(
        ["--base-url", f"{gateway_url}/v1", "--endpoint", "chat", "--num-requests", "2", "--output-len", "6"]
        + ["--concurrency", "2", "--warmup", "0", "--no-progress", "--tokenizer", str(stories_path)]
    )
    config = config_from_args(args)
    assert config.target.base_url == gateway_url and config.target.model == "stories260K"
    (result,) = run_sweep(config)
    assert result.summary["completed"] == 2
    assert [r.output_tokens for r in result.records] == [6, 6]


def test_server_errors_are_counted_not_raised(gateway_url, stories_path):
    (result, _) = sweep(gateway_url, stories_path, model="no-such-model", warmup=0)
    s = result.summary
    assert (s["completed"], s["failed"], s["output_tokens"]) == (0, 4, 0)
    assert len(s["errors"]) == 1 and s["errors"][0].startswith("HTTP 404: ")
    assert s["goodput"]["good_requests"] == 0
