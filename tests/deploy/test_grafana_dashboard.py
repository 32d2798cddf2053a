"""The chart's Grafana dashboard: shipped as a ConfigMap for Grafana's sidecar, and every PromQL expression
in it names only metrics that a real engine and a real gateway export (collected from a live scrape)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig, TelemetryConfig
from tests.deploy import chart_render
from tests.deploy.chart_render import find
from tests.deploy.paths import CHART
from tests.engine.support.server_thread import ServerThread
from tests.support.gateway_thread import GatewayThread
from tests.support.promql import exported_sample_names, metric_names
from tests.support.stories import MODEL, PROMPT

pytestmark = pytest.mark.deploy

DASHBOARD = CHART / "dashboards" / "conduit.json"
# What the dashboard must show (issue: throughput, TTFT/ITL percentiles, queue depth, KV usage,
# preemptions, error rates, per engine and per gateway).
MUST_SHOW = {
    "conduit_engine_generation_tokens_total",
    "conduit_engine_time_to_first_token_seconds_bucket",
    "conduit_engine_inter_token_latency_seconds_bucket",
    "conduit_engine_requests_waiting",
    "conduit_engine_kv_cache_usage_ratio",
    "conduit_engine_preemptions_total",
    "conduit_engine_requests_finished_total",
    "conduit_gateway_requests_total",
    "conduit_gateway_completion_tokens_total",
    "conduit_gateway_time_to_first_token_seconds_bucket",
    "conduit_gateway_inter_token_latency_seconds_bucket",
    "conduit_gateway_stream_errors_total",
}


def _panels(panels: list[dict]) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    found = []
    for panel in panels:
        found.append(panel)
        found += _panels(panel.get("panels", []))
    return found


def _expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    # Template variables query with Grafana's label_values(metric, label): the metric is a name too.
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            exprs += re.findall(r"label_values\(\s*([^,()]+?)\s*,", query)
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported(stories_path) -> set[str]:
    """Sample names a real engine (vLLM names off, as by default) and a real gateway export, after a
    streamed and a plain request went through them."""
    config = EngineConfig(
        model=ModelConfig(path=str(stories_path)),
        cache=CacheConfig(num_blocks=64),
        server=ServerConfig(host="127.0.0.1", port=0),
        telemetry=TelemetryConfig(metrics_port=0),
    )
    engine = ServerThread(config).start()
    try:
        with GatewayThread([engine.address]) as gateway:
            with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0) as client:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
                list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True))
            gateway_text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        engine_text = httpx.get(engine.metrics_url, timeout=10).text
    finally:
        engine.stop()
    return exported_sample_names(engine_text) | exported_sample_names(gateway_text)


def test_dashboard_ships_as_a_configmap_for_the_grafana_sidecar(dashboard):
    objects = chart_render.manifests(chart_render.render(chart_render.values("full")))
    config_map = find(objects, "ConfigMap", "conduit-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert json.loads(config_map["data"]["conduit.json"]) == dashboard
    # Off by default, like the ServiceMonitors: it needs Grafana's sidecar.
    default = chart_render.manifests(chart_render.render({}))
    assert "ConfigMap" not in chart_render.kinds(default)


def test_every_expression_names_only_exported_metrics(dashboard, exported):
    expressions = _expressions(dashboard)
    assert len(expressions) > 20
    used = set()
    for expr in expressions:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} reads {sorted(names - exported)}, which no service exports"
        used |= names
    assert MUST_SHOW <= used, sorted(MUST_SHOW - used)


def test_every_panel_reads_the_chosen_datasource_and_namespace(dashboard):
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "namespace"]
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            selectors = re.findall(r"\{([^}]*)\}", target["expr"])
            assert selectors and all('namespace="$namespace"' in s for s in selectors), target["expr"]
