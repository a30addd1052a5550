"""The Grafana dashboard: the committed JSON is the generator's output (cli/dashboard.py, Grafana's foundation SDK),
every query names only metrics our exporters expose and follows dashboard-linter's rules (the data source is the
dashboard's variable, rates use $__rate_interval, each query selects by namespace and pool), and the chart's
ConfigMap carries it for Grafana's sidecar, off by default."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from kubelora.cli import dashboard as generator

from .conftest import CHART
from .exported import exported_metric_names, promql_metric_names

NS = "kubelora-system"


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def test_committed_dashboard_is_the_generators_output():
    committed = (CHART / "dashboards" / "kubelora.json").read_text()
    assert committed == generator.render(), "regenerate: .venv/bin/python -P -m kubelora.cli.dashboard"


def test_every_query_uses_exported_metrics_the_datasource_variable_and_the_pool_selectors():
    exported = exported_metric_names()
    board = generator.build_dashboard()
    assert len(panels(board)) >= 16
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            used = promql_metric_names(expr)
            assert used and used <= exported, (panel["title"], used - exported)
            assert target["datasource"] == panel["datasource"] and target["refId"], panel["title"]
            assert 'namespace=~"$namespace"' in expr and '=~"$pool"' in expr, (panel["title"], expr)
            if "rate(" in expr:
                assert "[$__rate_interval]" in expr and expr.count("rate(") == expr.count("[$__rate_interval]"), expr
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "namespace", "pool", "adapter"}
    for name in ("namespace", "pool", "adapter"):
        metric = re.match(r"label_values\(([\w:]+)", variables[name]["query"])
        assert metric and metric.group(1) in exported, variables[name]["query"]


def test_dashboard_covers_the_asked_panels():
    used = {name for p in panels(generator.build_dashboard()) for t in p["targets"]
            for name in promql_metric_names(t["expr"])}
    for metric in ("kubelora_adapter_residency", "kubelora_requests_running", "kubelora_requests_waiting",
                   "kubelora_time_to_first_token_seconds_bucket", "kubelora_time_per_output_token_seconds_bucket",
                   "kubelora_generation_tokens_total", "kubelora_adapter_load_seconds_count",
                   "kubelora_adapter_host_load_seconds_count", "kubelora_adapter_evictions_total",
                   "kubelora_batch_adapters", "vllm:lora_requests_info", "kubelora_kv_cache_usage_ratio",
                   "kubelora_adapter_pool_bytes", "kubelora_router_placement_age_seconds",
                   "kubelora_router_upstream_errors_total", "kubelora_operator_reconcile_duration_seconds_bucket"):
        assert metric in used, metric


def test_chart_configmap_carries_the_dashboard_for_the_sidecar(render):
    assert not [key for key in render() if key[0] == "ConfigMap"]
    rendered = render(None, "metrics.grafanaDashboard.enabled=true", "metrics.grafanaDashboard.namespace=grafana")
    config_map = rendered[("ConfigMap", "rel-kubelora-dashboard", "grafana")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["kubelora.json"]) == generator.build_dashboard()
    here = render(None, "metrics.grafanaDashboard.enabled=true")
    assert ("ConfigMap", "rel-kubelora-dashboard", NS) in here


def test_every_query_parses_as_promql(promtool, tmp_path):
    """promtool checks each query as a recording rule, with Grafana's variables in the values Grafana gives them."""
    board = generator.build_dashboard()
    exprs = [t["expr"] for p in panels(board) for t in p["targets"]]
    exprs += [re.fullmatch(r"label_values\((.+), \w+\)", v["query"]).group(1)
              for v in board["templating"]["list"] if v["type"] == "query"]
    rules = [{"record": f"kubelora:panel_{i}", "expr": expr.replace("$__rate_interval", "1m").replace("$", "")}
             for i, expr in enumerate(exprs)]
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    checked = subprocess.run([promtool, "check", "rules", "panels.yaml"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
