"""The chart's monitoring objects (ServiceMonitor, PodMonitors, PrometheusRule) pass a server-side dry run against
prometheus-operator's own CRDs on the e2e API server, with strict field validation; the same objects with an
unknown field or a value the schema refuses are rejected, so the dry run does check them."""

from __future__ import annotations

import copy
import uuid

import pytest
import yaml

from .conftest import CI_VALUES
from .monitoring_crds import install_monitoring_crds

MONITORING = next(p for p in CI_VALUES if p.stem == "monitoring-values")
KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def namespace(cluster):
    name = f"klr-mon-dry-{uuid.uuid4().hex[:6]}"
    install_monitoring_crds(cluster)
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def objects(render, namespace) -> list[dict]:
    rendered = render(MONITORING, namespace=namespace)
    found = [m for (kind, _, _), m in rendered.items() if kind in KINDS]
    assert sorted(m["kind"] for m in found) == ["PodMonitor", "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    return found


def dry_run(cluster, manifest: dict):
    return cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                           stdin=yaml.safe_dump(manifest), check=False)


def test_monitoring_objects_pass_a_server_side_dry_run(cluster, objects):
    for manifest in objects:
        result = dry_run(cluster, manifest)
        assert result.returncode == 0, (manifest["kind"], manifest["metadata"]["name"], result.stderr)
        assert "(server dry run)" in result.stdout
    # A dry run creates nothing.
    left = cluster.kubectl("get", "servicemonitors,podmonitors,prometheusrules", "-n", objects[0]["metadata"]
                           ["namespace"], "-o", "name").stdout
    assert left.strip() == ""


def test_the_dry_run_refuses_what_the_crds_do_not_allow(cluster, objects):
    by_kind = {m["kind"]: m for m in objects}
    unknown_field = copy.deepcopy(by_kind["PodMonitor"])
    unknown_field["spec"]["podMetricsEndpoints"][0]["prot"] = "http"
    bad_interval = copy.deepcopy(by_kind["ServiceMonitor"])
    bad_interval["spec"]["endpoints"][0]["interval"] = "30 seconds"
    no_expr = copy.deepcopy(by_kind["PrometheusRule"])
    del no_expr["spec"]["groups"][0]["rules"][0]["expr"]
    for manifest, says in ((unknown_field, 'unknown field "spec.podMetricsEndpoints[0].prot"'),
                           (bad_interval, "spec.endpoints[0].interval"),
                           (no_expr, "expr")):
        result = dry_run(cluster, manifest)
        assert result.returncode != 0 and says in result.stderr, (manifest["kind"], result.stderr)
