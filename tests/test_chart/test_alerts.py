"""The chart's PrometheusRule: rendered by helm, its groups pass `promtool check rules` and the unit tests of
alerts_test.yaml (every alert fires in one); each alert queries only metrics our exporters expose, has a
severity, a summary, a description and a runbook link to a section of docs/runbook.md; each `for` is a chart
value."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import CHART, CI_VALUES
from .exported import exported_metric_names, promql_metric_names

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).with_name("alerts_test.yaml")
RUNBOOK_URL = "https://runbooks.test/runbook.md"  # what alerts_test.yaml expects in runbook_url
MONITORING = next(p for p in CI_VALUES if p.stem == "monitoring-values")
# The `for` the chart ships (metrics.prometheusRule.for); docs/runbook.md's durations are these.
SHIPPED_FOR = {"KubeloraAdapterThrash": "10m", "KubeloraAdapterQueueStuck": "5m", "KubeloraTTFTBudgetBurnFast": "2m",
               "KubeloraTTFTBudgetBurnSlow": "15m", "KubeloraRouterPlacementStale": "2m",
               "KubeloraPoolDegradedOrStalled": "5m", "KubeloraAdaptersDegraded": "10m",
               "KubeloraAdaptersStalled": "5m", "KubeloraOperatorNoLeader": "5m"}


@pytest.fixture(scope="session")
def groups(render) -> list[dict]:
    rendered = render(MONITORING, f"metrics.prometheusRule.runbookUrl={RUNBOOK_URL}")
    [rule] = [m for (kind, _, _), m in rendered.items() if kind == "PrometheusRule"]
    assert set(rule["spec"]) == {"groups"}
    return rule["spec"]["groups"]


def alerts(groups: list[dict]) -> list[dict]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_prometheus_rule_is_off_by_default_and_carries_the_selected_labels(render):
    assert not [key for key in render() if key[0] == "PrometheusRule"]
    [rule] = [m for (kind, _, _), m in render(MONITORING).items() if kind == "PrometheusRule"]
    labels = rule["metadata"]["labels"]
    assert labels["prometheus"] == "k8s" and labels["role"] == "alert-rules" and labels["release"] == "prometheus"


def test_rules_pass_promtool_check_and_unit_tests(groups, promtool, tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(TESTS, tmp_path / "alerts_test.yaml")
    checked = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_fires_in_a_unit_test(groups):
    fired = {case["alertname"] for test in yaml.safe_load(TESTS.read_text())["tests"]
             for case in test.get("alert_rule_test", []) if case.get("exp_alerts")}
    assert {a["alert"] for a in alerts(groups)} == fired


def test_alerts_query_only_exported_metrics(groups):
    exported = exported_metric_names()
    for alert in alerts(groups):
        used = promql_metric_names(alert["expr"])
        assert used and used <= exported, (alert["alert"], used - exported)


def test_alerts_have_severity_summary_description_and_a_runbook_section(groups):
    runbook = (REPO / "docs" / "runbook.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", runbook, re.MULTILINE)}
    for alert in alerts(groups):
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], alert["alert"]
        url, _, anchor = alert["annotations"]["runbook_url"].partition("#")
        assert url == RUNBOOK_URL and anchor == alert["alert"].lower() and anchor in anchors, alert["alert"]


def test_each_for_is_a_chart_value_shipped_unchanged(groups):
    values = yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["prometheusRule"]["for"]
    assert values == SHIPPED_FOR
    assert {a["alert"]: a["for"] for a in alerts(groups) if "for" in a} == SHIPPED_FOR


def test_a_for_from_the_values_is_the_alerts_for_and_in_its_description(render):
    rendered = render(MONITORING, "metrics.prometheusRule.for.KubeloraAdaptersDegraded=90s",
                      "metrics.prometheusRule.for.KubeloraAdapterThrash=1h30m")
    [rule] = [m for (kind, _, _), m in rendered.items() if kind == "PrometheusRule"]
    found = {a["alert"]: a for a in alerts(rule["spec"]["groups"])}
    assert {name: a["for"] for name, a in found.items() if "for" in a} == {
        **SHIPPED_FOR, "KubeloraAdaptersDegraded": "90s", "KubeloraAdapterThrash": "1h30m"}
    assert found["KubeloraAdaptersDegraded"]["annotations"]["description"].endswith("have been Degraded for 90s.")
    assert "FOR(" not in yaml.safe_dump(rule)  # every placeholder filled
