"""e2e/localprometheus.py's translation of the chart's monitors into Prometheus scrape jobs, without a cluster: the
jobs prometheus-operator would name, `keep` rules for exactly the selector's labels and the port, the target labels,
honorLabels; a monitor field it does not translate is an error. The e2e test (test_monitoring_prometheus.py) checks
the result against the API server's own selection."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import localprometheus
import pytest

from .conftest import CI_VALUES

MONITORING = next(p for p in CI_VALUES if p.stem == "monitoring-values")
KUBECONFIG = Path("/tmp/kubeconfig")


@pytest.fixture(scope="module")
def monitors(render) -> dict[str, dict]:
    rendered = render(MONITORING, "watchNamespaces={pools-a,pools-b}", namespace="ops")
    return {name: m for (kind, name, _), m in rendered.items() if kind in ("ServiceMonitor", "PodMonitor")}


def keeps(job: dict) -> dict[str, str]:
    return {rule["source_labels"][0]: rule["regex"] for rule in job["relabel_configs"] if rule.get("action") == "keep"}


def test_each_monitor_becomes_the_job_prometheus_operator_names(monitors):
    jobs = {job["job_name"]: job for job in localprometheus.scrape_configs(list(monitors.values()), KUBECONFIG)}
    assert set(jobs) == {"serviceMonitor/ops/rel-kubelora-engines/0", "podMonitor/ops/rel-kubelora-routers/0",
                         "podMonitor/ops/rel-kubelora-operator/0"}
    engines = jobs["serviceMonitor/ops/rel-kubelora-engines/0"]
    assert engines["kubernetes_sd_configs"] == [{"role": "endpointslice", "kubeconfig_file": str(KUBECONFIG),
                                                  "namespaces": {"names": ["pools-a", "pools-b"]}}]
    assert keeps(engines) == {
        "__meta_kubernetes_service_label_app_kubernetes_io_component": "(engine);true",
        "__meta_kubernetes_service_label_app_kubernetes_io_managed_by": r"(kubelora\-operator);true",
        "__meta_kubernetes_endpointslice_port_name": "http"}
    assert {"source_labels": ["__meta_kubernetes_service_label_kubelora_io_pool"],
            "target_label": "kubelora_io_pool"} in engines["relabel_configs"]
    assert not engines["honor_labels"] and engines["scrape_interval"] == "30s"
    operator = jobs["podMonitor/ops/rel-kubelora-operator/0"]
    assert operator["honor_labels"] and operator["kubernetes_sd_configs"][0]["namespaces"] == {"names": ["ops"]}
    assert keeps(operator)["__meta_kubernetes_pod_container_port_name"] == "metrics"
    assert {"target_label": "job", "replacement": "ops/rel-kubelora-operator"} in operator["relabel_configs"]


def test_selector_regexes_match_only_the_whole_value(monitors):
    routers = localprometheus.scrape_configs([monitors["rel-kubelora-routers"]], KUBECONFIG)[0]
    regex = keeps(routers)["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    # Prometheus anchors relabel regexes at both ends; Python's fullmatch does the same.
    assert re.fullmatch(regex, "router;true") and not re.fullmatch(regex, "router-x;true")
    assert not re.fullmatch(regex, "router;false") and not re.fullmatch(regex, ";")


def test_fields_it_does_not_translate_are_refused(monitors):
    relabelled = copy.deepcopy(monitors["rel-kubelora-routers"])
    relabelled["spec"]["podMetricsEndpoints"][0]["relabelings"] = [{"action": "drop"}]
    by_expression = copy.deepcopy(monitors["rel-kubelora-engines"])
    by_expression["spec"]["selector"]["matchExpressions"] = [{"key": "a", "operator": "Exists"}]
    job_label = copy.deepcopy(monitors["rel-kubelora-engines"])
    job_label["spec"]["jobLabel"] = "app"
    for monitor in (relabelled, by_expression, job_label):
        with pytest.raises(ValueError):
            localprometheus.scrape_configs([monitor], KUBECONFIG)


def test_rule_file_holds_the_prometheus_rules_groups_unchanged(render):
    [rule] = [m for (kind, _, _), m in render(MONITORING).items() if kind == "PrometheusRule"]
    assert localprometheus.rule_groups([rule, rule]) == {"groups": rule["spec"]["groups"] * 2}
