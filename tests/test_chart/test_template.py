"""`helm template` with each ci values file: what the manifests say (image, args, env, probes, RBAC, toggles)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from .conftest import CHART, CI_VALUES, KUBE_VERSION

CI = {p.stem: p for p in CI_VALUES}
NS = "kubelora-system"
REPO = Path(__file__).resolve().parents[2]
# The images `make images` builds (images/build.sh: localhost/<name>:<version>), as the operator gets them.
BUILT_IMAGES = {"KUBELORA_OPERATOR_ENGINE_IMAGE": "kubelora-engine:0.1.0",
                "KUBELORA_OPERATOR_ROUTER_IMAGE": "kubelora-router:0.1.0"}
# Leader election is on by default; POD_NAME and POD_NAMESPACE come from the downward API (no value).
ELECTION = {"KUBELORA_OPERATOR_LEADER_ELECT": "true", "KUBELORA_OPERATOR_LEADER_ELECT_LEASE": "rel-kubelora",
            "POD_NAME": None, "POD_NAMESPACE": None}


def container(rendered: dict) -> dict:
    [deployment] = [m for (kind, _, _), m in rendered.items() if kind == "Deployment"]
    [operator] = deployment["spec"]["template"]["spec"]["containers"]
    return operator


def env(rendered: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(rendered)["env"]}


def rules(rendered: dict, name: str) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs of one ClusterRole."""
    table: dict[tuple[str, str], set[str]] = {}
    for rule in rendered[("ClusterRole", name, None)]["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


def test_defaults_render_a_cluster_wide_operator(render):
    rendered = render(CI["default-values"])
    assert {(kind, name) for kind, name, _ in rendered} == {
        ("ServiceAccount", "rel-kubelora"), ("Deployment", "rel-kubelora"),
        ("ClusterRole", "rel-kubelora-discovery"), ("ClusterRoleBinding", "rel-kubelora-discovery"),
        ("ClusterRole", "rel-kubelora-pools"), ("ClusterRoleBinding", "rel-kubelora-pools"),
        ("Role", "rel-kubelora-leader-election"), ("RoleBinding", "rel-kubelora-leader-election")}
    operator = container(rendered)
    assert operator["image"] == "kubelora-operator:0.1.0"  # appVersion
    assert operator["args"] == ["operator"]
    assert env(rendered) == {"KUBELORA_OPERATOR_LIVENESS_PORT": "8081", **BUILT_IMAGES, **ELECTION}  # unset: defaults
    for probe in ("livenessProbe", "readinessProbe"):
        assert operator[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert operator["ports"] == [{"name": "healthz", "containerPort": 8081, "protocol": "TCP"}]
    deployment = rendered[("Deployment", "rel-kubelora", NS)]
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "rel-kubelora"
    binding = rendered[("ClusterRoleBinding", "rel-kubelora-pools", None)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kubelora", "namespace": NS}]


def test_rbac_is_least_privilege(render):
    pools = rules(render(CI["default-values"]), "rel-kubelora-pools")
    assert pools[("kubelora.io", "lorapools")] == pools[("kubelora.io", "loraadapters")] == {
        "get", "list", "watch", "patch"}
    assert pools[("kubelora.io", "lorapools/status")] == {"get", "patch"}
    assert pools[("kubelora.io", "lorapools/finalizers")] == {"update"}
    owned = {"get", "create", "update", "patch", "delete"}
    for key in (("apps", "deployments"), ("", "services"), ("", "serviceaccounts"),
                ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings")):
        assert pools[key] == owned, key
    assert pools[("", "configmaps")] == owned | {"list", "watch"}
    assert pools[("", "pods")] == {"get", "list", "watch"}
    assert pools[("", "events")] == {"create", "patch"}
    assert pools[("", "secrets")] == {"get"}
    everything = {verb for verbs in pools.values() for verb in verbs}
    assert not everything & {"*", "escalate", "bind", "impersonate", "deletecollection"}
    assert not any("*" in key for key in pools)
    discovery = rules(render(CI["default-values"]), "rel-kubelora-discovery")
    assert discovery == {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
                         ("", "namespaces"): {"get", "list", "watch"}}


def test_watched_namespaces_get_role_bindings_and_settings_become_env(render):
    rendered = render(CI["namespaced-values"], namespace="ops")
    assert ("ClusterRoleBinding", "rel-kubelora-pools", None) not in rendered
    for namespace in ("team-a", "team-b"):
        binding = rendered[("RoleBinding", "rel-kubelora-pools", namespace)]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": "rel-kubelora-pools"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kubelora", "namespace": "ops"}]
    operator = container(rendered)
    assert operator["image"] == "registry.example.com/kubelora/operator:v0.1.0-test"
    assert operator["args"] == ["operator", "--engine-timeout-seconds", "60"]
    assert env(rendered) == {"KUBELORA_OPERATOR_LIVENESS_PORT": "8081", **BUILT_IMAGES, **ELECTION,
                             "KUBELORA_OPERATOR_NAMESPACES": "team-a,team-b", "KUBELORA_OPERATOR_RESYNC_S": "15",
                             "KUBELORA_OPERATOR_MAX_CONCURRENT_CALLS": "8", "KUBELORA_OPERATOR_VERBOSE": "true",
                             "EXTRA": "1"}


def test_leader_election_gets_a_lease_role_in_the_release_namespace(render, helm):
    rendered = render(CI["default-values"])
    role = rendered[("Role", "rel-kubelora-leader-election", NS)]
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["rel-kubelora"],
         "verbs": ["get", "update"]}]
    binding = rendered[("RoleBinding", "rel-kubelora-leader-election", NS)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kubelora", "namespace": NS}]
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(rendered)["env"]
                if "valueFrom" in e}
    assert downward == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    # One replica without election: Recreate, no Lease, no Role; two without it refuse to render.
    single = render(None, "operator.replicas=1", "operator.leaderElection.enabled=false")
    deployment = single[("Deployment", "rel-kubelora", NS)]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert "KUBELORA_OPERATOR_LEADER_ELECT" not in env(single)
    assert ("Role", "rel-kubelora-leader-election", NS) not in single
    refused = subprocess.run([helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION,
                              "--set", "operator.leaderElection.enabled=false"], capture_output=True, text=True)
    assert refused.returncode != 0 and "needs operator.leaderElection.enabled" in refused.stderr


def test_service_monitor_is_off_by_default_and_on_when_asked(render):
    assert not [key for key in render(CI["default-values"]) if key[0] == "ServiceMonitor"]
    rendered = render(CI["servicemonitor-values"])
    monitor = rendered[("ServiceMonitor", "rel-kubelora-engines", NS)]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "kubelora-operator",
                                                          "app.kubernetes.io/component": "engine"}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    scoped = render(CI["servicemonitor-values"], "watchNamespaces={team-a}")
    assert scoped[("ServiceMonitor", "rel-kubelora-engines", NS)]["spec"]["namespaceSelector"] == {
        "matchNames": ["team-a"]}


def test_existing_service_account_without_rbac(render):
    rendered = render(CI["existing-serviceaccount-values"])
    assert {kind for kind, _, _ in rendered} == {"Deployment"}
    deployment = rendered[("Deployment", "rel-kubelora", NS)]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "platform-kubelora"


def test_crds_are_not_templated(render):
    """Helm installs crds/ itself, before the templates; rendering never includes them."""
    assert not [key for key in render() if key[0] == "CustomResourceDefinition"]
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == ["loraadapters.yaml", "lorapools.yaml"]


@pytest.mark.parametrize("name", sorted(CI))
def test_every_object_is_labelled_by_the_release(render, name):
    for (kind, obj, _), manifest in render(CI[name]).items():
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "rel" and labels["app.kubernetes.io/managed-by"] == "Helm", \
            (kind, obj)


@pytest.mark.parametrize("bad, field", [("operator.livenessPort=http", "livenessPort"),
                                        ("watchNamespaces={Team_A}", "watchNamespaces"),
                                        ("operator.maxConcurrentCalls=0", "maxConcurrentCalls"),
                                        ("metrics.serviceMonitor.interval=often", "interval"),
                                        ("operater.verbose=true", "operater")])
def test_values_schema_refuses_bad_values(helm, bad, field):
    result = subprocess.run([helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, "--set", bad],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and field in result.stderr, result.stderr


def test_images_come_from_one_registry_and_the_chart_version(render):
    rendered = render(CI["registry-values"])
    assert container(rendered)["image"] == "registry.example.com:5000/ml/kubelora-operator:0.1.0"
    images = {k: v for k, v in env(rendered).items() if k.endswith("_IMAGE")}
    assert images == {"KUBELORA_OPERATOR_ENGINE_IMAGE": "registry.example.com:5000/ml/kubelora-engine:0.1.0-cuda",
                      "KUBELORA_OPERATOR_ROUTER_IMAGE": "registry.example.com:5000/ml/kubelora-router:0.1.0"}


def test_rendered_images_are_the_ones_make_images_builds(render):
    # images/<name>/Dockerfile for each name the chart renders, and the tag is the version pyproject.toml builds.
    rendered = render(CI["default-values"])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    refs = [container(rendered)["image"], *(v for k, v in env(rendered).items() if k.endswith("_IMAGE"))]
    for ref in refs:
        name, tag = ref.split(":")
        assert (REPO / "images" / name / "Dockerfile").is_file(), ref
        assert tag == version, ref
