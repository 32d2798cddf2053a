"""The metric names a PromQL expression reads, and the sample names a live scrape exports.

A small reader, not a full PromQL parser: it removes what can hold identifiers that are not metric names
(strings, label matchers, range and subquery brackets, grouping label lists) and keeps the remaining
identifiers that are not functions, aggregations or keywords. tests/suite/test_promql.py checks it on
the constructs dashboards use.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["exported_sample_names", "metric_names"]

_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}
    | {"inf", "nan", "Inf", "NaN", "start", "end"}
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric (sample) names `expr` selects, e.g. {"x_bucket"} for histogram_quantile over x_bucket."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        word = match.group(0)
        if word in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue  # a keyword, or a function / aggregation call
        names.add(word)
    return names


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "unknown": ("",),
}


def exported_sample_names(exposition: str) -> set[str]:
    """Every sample name the Prometheus text `exposition` declares, also for families that have no sample
    yet (a labelled counter nothing has incremented still declares its name with # TYPE)."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return names
