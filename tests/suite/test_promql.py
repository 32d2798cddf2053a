"""tests/support/promql.py: metric names of the PromQL constructs dashboards use, and exported names."""

from __future__ import annotations

import pytest

from tests.support.promql import exported_sample_names, metric_names

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('sum by (pod) (rate(x_total{namespace="$namespace"}[$__rate_interval]))', {"x_total"}),
        (
            'histogram_quantile(0.99, sum by (le, model) (rate(ttft_seconds_bucket{a=~"b.*"}[5m])))',
            {"ttft_seconds_bucket"},
        ),
        (
            "sum(rate(a_total[1m])) by (le) / sum(rate(b_total[1m])) without (instance)",
            {"a_total", "b_total"},
        ),
        ('a / on(pod) group_left(model) b{x="by (c)"}', {"a", "b"}),
        ("max_over_time(g[1h:5m]) offset 5m > bool 0.5", {"g"}),
        ("vllm:kv_cache_usage_perc * 100 + 1e3", {"vllm:kv_cache_usage_perc"}),
        ('label_replace(x, "dst", "$1", "src", "(.*)")', {"x"}),
        ("topk(5, sum by (pod) (y)) and z unless w or v", {"y", "z", "w", "v"}),
    ],
)
def test_metric_names(expr, names):
    assert metric_names(expr) == names


def test_exported_names_include_families_without_samples():
    exposition = """\
# HELP c_total Counted.
# TYPE c_total counter
c_total 1.0
# HELP e_total Errors by code.
# TYPE e_total counter
# HELP h Seconds.
# TYPE h histogram
h_bucket{le="+Inf"} 0.0
h_count 0.0
h_sum 0.0
# HELP g A gauge.
# TYPE g gauge
g 2.0
"""
    names = exported_sample_names(exposition)
    assert {"c_total", "e_total", "h_bucket", "h_sum", "h_count", "g"} <= names
    assert "e" not in names and "h" not in names
