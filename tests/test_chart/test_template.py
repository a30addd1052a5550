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
                "KUBELORA_OPERATOR_ROUTER_IMAGE": "kubelora-operator:0.1.0"}
# Leader election is on by default; POD_NAME and POD_NAMESPACE come from the downward API (no value).
ELECTION = {"KUBELORA_OPERATOR_LEADER_ELECT": "true", "KUBELORA_OPERATOR_LEADER_ELECT_LEASE": "rel-kubelora",
            "POD_NAME": None, "POD_NAMESPACE": None}
# The engine NetworkPolicies are on by default and admit the operator's own pods (its selector labels).
OPERATOR_LABELS = "app.kubernetes.io/name=kubelora,app.kubernetes.io/instance=rel,app.kubernetes.io/component=operator"


def network(namespace: str = NS, enabled: str = "true") -> dict[str, str]:
    return {"KUBELORA_OPERATOR_NETWORK_POLICY": enabled, "KUBELORA_OPERATOR_POD_NAMESPACE": namespace,
            "KUBELORA_OPERATOR_POD_LABELS": OPERATOR_LABELS}


def container(rendered: dict) -> dict:
    [deployment] = [m for (kind, _, _), m in rendered.items() if kind == "Deployment"]
    [operator] = deployment["spec"]["template"]["spec"]["containers"]
    return operator


def env(rendered: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(rendered)["env"]}


def rules(rendered: dict, name: str, kind: str = "ClusterRole", namespace: str | None = None
          ) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs of one ClusterRole (or Role)."""
    table: dict[tuple[str, str], set[str]] = {}
    for rule in rendered[(kind, name, namespace)]["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


def test_defaults_render_an_operator_of_the_release_namespace(render):
    rendered = render(CI["default-values"])
    assert {(kind, name, namespace) for kind, name, namespace in rendered} == {
        ("ServiceAccount", "rel-kubelora", NS), ("Deployment", "rel-kubelora", NS),
        ("ClusterRole", "rel-kubelora-discovery", None), ("ClusterRoleBinding", "rel-kubelora-discovery", None),
        ("Role", "rel-kubelora-pools", NS), ("RoleBinding", "rel-kubelora-pools", NS),
        ("Role", "rel-kubelora-leader-election", NS), ("RoleBinding", "rel-kubelora-leader-election", NS)}
    operator = container(rendered)
    assert operator["image"] == "kubelora-operator:0.1.0"  # appVersion
    assert operator["args"] == ["operator"]
    assert env(rendered) == {"KUBELORA_OPERATOR_LIVENESS_PORT": "8081", "KUBELORA_OPERATOR_METRICS_PORT": "8080", **BUILT_IMAGES, **ELECTION,
                             "KUBELORA_OPERATOR_NAMESPACES": NS, **network()}  # unset: defaults
    for probe in ("livenessProbe", "readinessProbe"):
        assert operator[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert operator["ports"] == [{"name": "healthz", "containerPort": 8081, "protocol": "TCP"},
                                 {"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    deployment = rendered[("Deployment", "rel-kubelora", NS)]
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "rel-kubelora"
    binding = rendered[("RoleBinding", "rel-kubelora-pools", NS)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kubelora", "namespace": NS}]


def cluster_wide_grants(rendered: dict) -> set[tuple[str, str]]:
    """(apiGroup, resource) some ClusterRoleBinding grants in every namespace."""
    bound = {m["roleRef"]["name"] for (kind, _, _), m in rendered.items() if kind == "ClusterRoleBinding"}
    return {key for name in bound for key in rules(rendered, name)}


@pytest.mark.parametrize("name", ["default-values", "registry-values", "servicemonitor-values"])
def test_the_default_grants_no_workloads_or_secrets_cluster_wide(render, name):
    """Creating Deployments anywhere lets the ServiceAccount run a pod as any ServiceAccount of any namespace
    (kube-system included); reading Secrets anywhere reads every token. Neither is granted unless opted in."""
    grants = cluster_wide_grants(render(CI[name]))
    assert grants == {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}
    cluster_roles = [m for (kind, _, _), m in render(CI[name]).items() if kind == "ClusterRole"]
    assert not [rule for role in cluster_roles for rule in role["rules"]
                if {"deployments", "secrets", "pods", "roles", "rolebindings"} & set(rule["resources"])]


def test_cluster_wide_is_an_opt_in_that_never_binds_secrets_cluster_wide(render, helm):
    rendered = render(CI["cluster-wide-values"])
    assert "KUBELORA_OPERATOR_NAMESPACES" not in env(rendered)  # the operator watches every namespace
    assert rules(rendered, "rel-kubelora-pools") == {k: v for k, v in POOL_RULES.items() if k != ("", "secrets")}
    assert ("", "secrets") not in cluster_wide_grants(rendered) and ("apps", "deployments") in cluster_wide_grants(
        rendered)
    assert rules(rendered, "rel-kubelora-secrets") == {("", "secrets"): {"get", "list", "create"}}
    for namespace in ("team-a", "team-b"):
        binding = rendered[("RoleBinding", "rel-kubelora-secrets", namespace)]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": "rel-kubelora-secrets"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kubelora", "namespace": NS}]
    assert not [key for key in rendered if key[0] == "Role" and key[1] == "rel-kubelora-pools"]
    both = subprocess.run([helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, "--set",
                           "clusterWide.enabled=true", "--set", "watchNamespaces={a}"], capture_output=True, text=True)
    assert both.returncode != 0 and "exclude each other" in both.stderr


POOL_RULES = {
    ("kubelora.io", "lorapools"): {"get", "list", "watch", "patch"},
    ("kubelora.io", "loraadapters"): {"get", "list", "watch", "patch"},
    ("kubelora.io", "lorapools/status"): {"get", "patch"}, ("kubelora.io", "loraadapters/status"): {"get", "patch"},
    ("kubelora.io", "lorapools/finalizers"): {"update"}, ("kubelora.io", "loraadapters/finalizers"): {"update"},
    # The owned objects: list and watch for the watches that re-apply one as soon as it is deleted.
    **{key: {"get", "list", "watch", "create", "update", "patch", "delete"} for key in (
        ("apps", "deployments"), ("", "services"), ("", "serviceaccounts"), ("", "configmaps"),
        ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings"))},
    ("", "pods"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch"}, ("events.k8s.io", "events"): {"create", "patch"},
    # The pool's admin token Secret is created once; tenant API key Secrets are listed by label; Secrets are
    # never watched, updated or deleted.
    ("", "secrets"): {"get", "list", "create"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "watch", "create", "patch", "delete"},
}


def test_rbac_is_least_privilege(render):
    pools = rules(render(CI["default-values"]), "rel-kubelora-pools", "Role", NS)
    assert pools == POOL_RULES
    assert pools[("kubelora.io", "lorapools")] == pools[("kubelora.io", "loraadapters")] == {
        "get", "list", "watch", "patch"}
    assert pools[("kubelora.io", "lorapools/status")] == {"get", "patch"}
    assert pools[("kubelora.io", "lorapools/finalizers")] == {"update"}
    owned = {"get", "list", "watch", "create", "update", "patch", "delete"}
    for key in (("apps", "deployments"), ("", "services"), ("", "serviceaccounts"),
                ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings")):
        assert pools[key] == owned, key
    assert pools[("", "configmaps")] == owned  # the router Role grants only get, by name
    assert pools[("", "pods")] == {"get", "list", "watch"}
    assert pools[("", "events")] == {"create", "patch"}
    assert pools[("", "secrets")] == {"get", "list", "create"}
    everything = {verb for verbs in pools.values() for verb in verbs}
    assert not everything & {"*", "escalate", "bind", "impersonate", "deletecollection"}
    assert not any("*" in key for key in pools)
    discovery = rules(render(CI["default-values"]), "rel-kubelora-discovery")
    assert discovery == {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
                         ("", "namespaces"): {"get", "list", "watch"}}


def test_watched_namespaces_get_roles_and_bindings_and_settings_become_env(render):
    rendered = render(CI["namespaced-values"], namespace="ops")
    # Nothing for pools cluster-wide: no ClusterRole to bind, no ClusterRoleBinding; Secrets only in team-a/b.
    assert ("ClusterRoleBinding", "rel-kubelora-pools", None) not in rendered
    assert ("ClusterRole", "rel-kubelora-pools", None) not in rendered
    cluster_wide = [m for (kind, _, _), m in rendered.items() if kind == "ClusterRole"]
    assert all(rule["resources"] != ["secrets"] for role in cluster_wide for rule in role["rules"])
    for namespace in ("team-a", "team-b"):
        assert rules(rendered, "rel-kubelora-pools", "Role", namespace) == POOL_RULES
        binding = rendered[("RoleBinding", "rel-kubelora-pools", namespace)]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": "rel-kubelora-pools"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-kubelora", "namespace": "ops"}]
    roles = {(kind, namespace) for kind, name, namespace in rendered if kind in ("Role", "RoleBinding")
             and name == "rel-kubelora-pools"}
    assert roles == {(kind, ns) for kind in ("Role", "RoleBinding") for ns in ("team-a", "team-b")}
    operator = container(rendered)
    assert operator["image"] == "registry.example.com/kubelora/operator:v0.1.0-test"
    assert operator["args"] == ["operator", "--engine-timeout-seconds", "60"]
    assert env(rendered) == {"KUBELORA_OPERATOR_LIVENESS_PORT": "8081", "KUBELORA_OPERATOR_METRICS_PORT": "8080", **BUILT_IMAGES, **ELECTION,
                             "KUBELORA_OPERATOR_NAMESPACES": "team-a,team-b", "KUBELORA_OPERATOR_RESYNC_S": "15",
                             "KUBELORA_OPERATOR_MAX_CONCURRENT_CALLS": "8", "KUBELORA_OPERATOR_VERBOSE": "true",
                             **network("ops"), "EXTRA": "1"}


def test_network_policies_are_on_by_default_and_switch_off(render):
    assert env(render(CI["default-values"]))["KUBELORA_OPERATOR_NETWORK_POLICY"] == "true"
    off = render(CI["default-values"], "networkPolicy.enabled=false")
    assert env(off) == {"KUBELORA_OPERATOR_LIVENESS_PORT": "8081", "KUBELORA_OPERATOR_METRICS_PORT": "8080", **BUILT_IMAGES, **ELECTION,
                        "KUBELORA_OPERATOR_NAMESPACES": NS, **network(enabled="false")}
    # The labels the operator puts in the policies select its own pods.
    [deployment] = [m for (kind, _, _), m in off.items() if kind == "Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert dict(item.split("=") for item in OPERATOR_LABELS.split(",")).items() <= pod_labels.items()


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
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    everywhere = render(CI["servicemonitor-values"], "clusterWide.enabled=true")
    assert everywhere[("ServiceMonitor", "rel-kubelora-engines", NS)]["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    scoped = render(CI["servicemonitor-values"], "watchNamespaces={team-a}")
    assert scoped[("ServiceMonitor", "rel-kubelora-engines", NS)]["spec"]["namespaceSelector"] == {
        "matchNames": ["team-a"]}


def test_pod_monitors_scrape_the_routers_and_the_operator(render):
    assert not [key for key in render(CI["default-values"]) if key[0] == "PodMonitor"]
    rendered = render(CI["servicemonitor-values"], "operator.metricsPort=9100")
    routers = rendered[("PodMonitor", "rel-kubelora-routers", NS)]
    assert routers["metadata"]["labels"]["release"] == "prometheus"
    assert routers["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "kubelora-operator",
                                                          "app.kubernetes.io/component": "router"}
    assert routers["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    assert routers["spec"]["podTargetLabels"] == ["kubelora.io/pool"]
    assert routers["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    operator = rendered[("PodMonitor", "rel-kubelora-operator", NS)]
    deployment = rendered[("Deployment", "rel-kubelora", NS)]
    assert operator["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    [endpoint] = operator["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "15s"}
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container(rendered)["ports"]
    assert env(rendered)["KUBELORA_OPERATOR_METRICS_PORT"] == "9100"


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
                                        ("clusterWide.secretNamespaces={Team_A}", "secretNamespaces"),
                                        ("clusterWide.enabled=yes", "enabled"),
                                        ("operator.maxConcurrentCalls=0", "maxConcurrentCalls"),
                                        ("metrics.serviceMonitor.interval=often", "interval"),
                                        ("operator.metricsPort=0", "metricsPort"),
                                        ("metrics.prometheusRule.enabled=yes", "enabled"),
                                        ("metrics.prometheusRule.for.KubeloraAdapterThrash=soon",
                                         "KubeloraAdapterThrash"),
                                        ("metrics.prometheusRule.for.KubeloraAdapterTrash=1m", "KubeloraAdapterTrash"),
                                        ("operater.verbose=true", "operater"),
                                        ("networkPolicy.enabled=maybe", "enabled")])
def test_values_schema_refuses_bad_values(helm, bad, field):
    result = subprocess.run([helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, "--set", bad],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and field in result.stderr, result.stderr


def test_images_come_from_one_registry_and_the_chart_version(render):
    rendered = render(CI["registry-values"])
    assert container(rendered)["image"] == "registry.example.com:5000/ml/kubelora-operator:0.1.0"
    images = {k: v for k, v in env(rendered).items() if k.endswith("_IMAGE")}
    assert images == {"KUBELORA_OPERATOR_ENGINE_IMAGE": "registry.example.com:5000/ml/kubelora-engine:0.1.0-cuda",
                      "KUBELORA_OPERATOR_ROUTER_IMAGE": "registry.example.com:5000/ml/kubelora-operator:0.1.0"}


def test_rendered_images_are_the_ones_make_images_builds(render):
    # images/<name>/Dockerfile for each name the chart renders, and the tag is the version pyproject.toml builds.
    rendered = render(CI["default-values"])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    refs = [container(rendered)["image"], *(v for k, v in env(rendered).items() if k.endswith("_IMAGE"))]
    for ref in refs:
        name, tag = ref.split(":")
        assert (REPO / "images" / name / "Dockerfile").is_file(), ref
        assert tag == version, ref
