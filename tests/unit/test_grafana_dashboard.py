"""docs/grafana/pdserve.json: importable (its datasource a template variable) and
naming only metrics the router exports. Here against every metric family the router
declares; tests/disagg/test_http.py checks the same against a served cluster's
/metrics after requests were served (names with their samples' suffixes)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from router.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pdserve.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
# PromQL words that are neither functions (followed by "(") nor metrics.
KEYWORDS = {"and", "or", "unless", "bool", "group_left", "group_right", "inf", "nan"}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query target."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers, less strings,
    label matchers, range selectors, grouping clauses, numbers, functions and
    keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\boffset\s+-?[\w.]+", "", expr)
    expr = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", expr):
        if not re.match(r"\s*\(", expr[match.end():]) and match.group().lower() not in KEYWORDS:
            names.add(match.group())
    return names


def missing_metrics(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    """'panel: metric' for every metric a panel reads that is not in `exported`."""
    return sorted({f"{title}: {name}" for title, expr in expressions(dashboard)
                   for name in metric_names(expr) if name not in exported})


def test_metric_names_come_out_of_promql() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, worker) (rate(pdserve_x_bucket{role="de code"}[5m]))) '
            '/ on(worker) group_left pdserve_y - 1e9 and bool pdserve_z offset 5m')
    assert metric_names(expr) == {"pdserve_x_bucket", "pdserve_y", "pdserve_z"}


def test_a_panel_naming_a_metric_that_does_not_exist_is_caught() -> None:
    dashboard = load_dashboard()
    dashboard["panels"][0]["targets"][0]["expr"] = "rate(pdserve_no_such_metric[1m])"
    exported = {name for _, expr in expressions(load_dashboard()) for name in metric_names(expr)}
    assert missing_metrics(dashboard, exported) == [f"{dashboard['panels'][0]['title']}: pdserve_no_such_metric"]


def test_the_dashboard_is_importable_with_a_datasource_variable() -> None:
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        assert all(metric_names(t["expr"]) for t in panel["targets"]), panel["title"]
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("requests per second", "time to first token", "time per output token", "kv cache used",
                  "kv transfer", "fallbacks", "step time", "batch size"):
        assert topic in titles


def test_every_metric_the_dashboard_reads_is_one_the_router_declares() -> None:
    declared = {family.name for family in RouterMetrics().registry.collect()}
    exported = {family + suffix for family in declared for suffix in ("", *SUFFIXES)}
    assert missing_metrics(load_dashboard(), exported) == []


@pytest.mark.parametrize("name", ["pdserve_worker_step_seconds_bucket", "pdserve_time_per_output_token_seconds_bucket",
                                  "pdserve_worker_kv_bytes_received", "pdserve_worker_prefill_tokens_computed"])
def test_the_dashboard_reads_the_new_figures(name: str) -> None:
    assert any(name in metric_names(expr) for _, expr in expressions(load_dashboard()))
