"""`helm install` into the local e2e cluster (docs/cluster.md): CRDs established, RBAC in place and enough for the
operator's work, the operator Deployment Ready; then `helm uninstall` removes what the chart made.

The operator watches only this test's namespace (watchNamespaces), so it never touches pools of other suites
sharing the cluster. The probe pool has 0 engine replicas: the operator still applies every object a pool owns
(Deployments, Services, the router's ServiceAccount, Role and RoleBinding, the placement ConfigMap, the admin
token Secret, the engine NetworkPolicy) and writes
status, which is what the chart's RBAC must allow. A `helm upgrade` of one setting then rolls the operator.
"""

from __future__ import annotations

import json
import uuid

from pytest_cluster import wait_for

from .conftest import CHART, run_helm

CRDS = ("lorapools.kubelora.io", "loraadapters.kubelora.io")
# The image `make images` builds; the local kubelet runs it from build/images (docs/cluster.md).
LOCAL_IMAGE = "kubelora-operator"
PROBE_POOL = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAPool
metadata: {name: rbac-probe}
spec:
  replicas: 0
  model: {path: /models/none}
  router: {enabled: true}
"""


def _established(cluster, crd: str) -> bool:
    conditions = cluster.get_json("crd", crd)["status"].get("conditions", [])
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def _can(cluster, namespace: str, service_account: str, verb: str, resource: str, in_namespace: str) -> bool:
    result = cluster.kubectl("auth", "can-i", verb, resource, "-n", in_namespace,
                             f"--as=system:serviceaccount:{namespace}:{service_account}", check=False)
    return result.stdout.strip() == "yes"


def _operator_pod(cluster, namespace: str) -> dict | None:
    pods = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator")["items"]
    return pods[0] if pods else None


def _is_ready(pod: dict | None) -> bool:
    conditions = (pod or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_install_runs_the_operator_and_uninstall_cleans_up(cluster, helm):
    namespace = f"klr-chart-{uuid.uuid4().hex[:6]}"
    release = "kubelora"
    name = "kubelora"  # the release name contains the chart name: fullname is the release name
    kube = ["--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace]
    run_helm(helm, "install", release, str(CHART), *kube, "--create-namespace",
             "--set", f"watchNamespaces={{{namespace}}}", "--set", f"image.repository={LOCAL_IMAGE}")
    try:
        for crd in CRDS:
            wait_for(f"CRD {crd} established", lambda crd=crd: _established(cluster, crd), timeout_s=60)
        assert cluster.get_json("serviceaccount", name, "-n", namespace)
        # watchNamespaces: a Role and RoleBinding there, nothing cluster-wide for pools.
        assert cluster.get_json("rolebinding", f"{name}-pools", "-n", namespace)["roleRef"]["kind"] == "Role"
        assert cluster.get_json("role", f"{name}-pools", "-n", namespace)
        assert cluster.get_json("clusterrole", f"{name}-discovery")
        for kind in ("clusterrole", "clusterrolebinding"):
            assert cluster.kubectl("get", kind, f"{name}-pools", check=False).returncode != 0
        # Least privilege, as the API server evaluates it for the operator's ServiceAccount.
        assert _can(cluster, namespace, name, "patch", "lorapools.kubelora.io", namespace)
        assert _can(cluster, namespace, name, "create", "roles", namespace)
        assert _can(cluster, namespace, name, "get", "secrets", namespace)
        assert _can(cluster, namespace, name, "create", "secrets", namespace)  # a pool's admin token, once
        assert _can(cluster, namespace, name, "list", "secrets", namespace)  # tenant API key Secrets, by label
        assert not _can(cluster, namespace, name, "list", "secrets", "default")
        assert not _can(cluster, namespace, name, "update", "secrets", namespace)
        assert not _can(cluster, namespace, name, "get", "secrets", "default")  # Secrets only where it watches
        assert _can(cluster, namespace, name, "create", "networkpolicies.networking.k8s.io", namespace)
        assert _can(cluster, namespace, name, "watch", "configmaps", namespace)  # owned objects healed on delete
        assert not _can(cluster, namespace, name, "watch", "secrets", namespace)
        assert not _can(cluster, namespace, name, "create", "deployments", "default")  # not a watched namespace
        assert not _can(cluster, namespace, name, "create", "pods", namespace)

        pod = wait_for("operator pod", lambda: _operator_pod(cluster, namespace), timeout_s=60)
        [container] = pod["spec"]["containers"]
        assert container["args"] == ["operator"] and container["image"] == f"{LOCAL_IMAGE}:0.1.0"
        assert {"name": "KUBELORA_OPERATOR_NAMESPACES", "value": namespace} in container["env"]
        wait_for("operator pod Ready", lambda: _is_ready(_operator_pod(cluster, namespace)), timeout_s=120)
        # Two replicas, both Ready (a standby answers its probes); one holds the release's Lease.
        wait_for("2 operator replicas available", lambda: cluster.get_json("deployment", name, "-n", namespace)
                 ["status"].get("availableReplicas") == 2, timeout_s=120)
        pods = {p["metadata"]["name"] for p in cluster.get_json(
            "pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator")["items"]}
        holder = wait_for("the Lease held", lambda: cluster.get_json("lease", name, "-n", namespace)
                          ["spec"].get("holderIdentity"), timeout_s=30)
        assert holder.rsplit("_", 1)[0] in pods
        assert _can(cluster, namespace, name, "update", f"leases/{name}", namespace)
        assert not _can(cluster, namespace, name, "update", "leases/other", namespace)

        cluster.apply(PROBE_POOL, namespace=namespace)
        placement = wait_for("the operator's objects for the probe pool", lambda: cluster.kubectl(
            "get", "configmap", "rbac-probe-placement", "-n", namespace, "-o", "json", check=False).stdout,
            timeout_s=90)
        assert json.loads(json.loads(placement)["data"]["placement.json"])["replicas"] == []
        for kind, obj in (("deployment", "rbac-probe-engine"), ("deployment", "rbac-probe-router"),
                          ("role", "rbac-probe-router"), ("rolebinding", "rbac-probe-router"),
                          ("serviceaccount", "rbac-probe-router"), ("service", "rbac-probe"),
                          ("secret", "rbac-probe-engine-admin"), ("networkpolicy", "rbac-probe-engine")):
            wait_for(f"{kind}/{obj}", lambda kind=kind, obj=obj: cluster.get_json(kind, obj, "-n", namespace),
                     timeout_s=60)
        status = wait_for("pool status", lambda: cluster.get_json("lorapool", "rbac-probe", "-n", namespace)
                          .get("status", {}).get("conditions"), timeout_s=60)
        assert status
        cluster.kubectl("delete", "lorapool", "rbac-probe", "-n", namespace, "--timeout=60s")

        # An upgrade that changes a setting rolls the operator pods to ones that have it.
        run_helm(helm, "upgrade", release, str(CHART), *kube, "--reuse-values", "--set", "operator.resyncSeconds=10")
        wait_for("the upgraded operator Ready", lambda: _is_ready(pod := _operator_pod(cluster, namespace))
                 and {"name": "KUBELORA_OPERATOR_RESYNC_S", "value": "10"} in pod["spec"]["containers"][0]["env"],
                 timeout_s=120)
    finally:
        run_helm(helm, "uninstall", release, *kube, "--wait", "--timeout", "60s")
    assert cluster.kubectl("get", "deployment", name, "-n", namespace, check=False).returncode != 0
    assert cluster.kubectl("get", "clusterrole", f"{name}-discovery", check=False).returncode != 0
    assert cluster.kubectl("get", "role", f"{name}-pools", "-n", namespace, check=False).returncode != 0
    for crd in CRDS:  # Helm never deletes CRDs (that would delete every pool and adapter)
        assert _established(cluster, crd)
    cluster.kubectl("delete", "namespace", namespace, "--timeout=90s")
