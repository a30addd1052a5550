"""Two operator replicas, as the chart installs them (leader election on a Lease), on the real API server.

The leader is killed (kill -9 of its process) in the middle of 20 adapter creates: the standby takes the Lease
within 15 s, every adapter becomes Ready, and the engine saw exactly one load call per adapter (its
`adapter_loaded` log lines, one per call, whether or not the adapter was loaded already).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter

import pytest

from pytest_cluster import wait_for

from .conftest import REPO, _delete_kubelora_objects

NUM_ADAPTERS = 20
KILL_AFTER = 8  # creates applied before the leader is killed
TAKEOVER_S = 15.0
RELEASE = "kubelora"  # the release name contains the chart name: objects and the Lease are named `kubelora`
# One engine pod holding all 20 (capacity: maxCpuLoras slots, and 20 rank-4 adapters in 12 x rank-8 rows).
POOL = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAPool
metadata: {{name: lead}}
spec:
  model: {{path: /models/tiny, servedName: tiny}}
  modelVolume: {{hostPath: {models}, mountPath: /models}}
  adapterVolume: {{hostPath: {adapters}, mountPath: /adapters}}
  adapterRoots: [/adapters]
  adminTokenSecretRef: {{name: engine-admin, key: token}}
  replicas: 1
  router: {{enabled: false}}
  engine: {{device: cpu, maxLoras: 12, maxLoraRank: 8, maxCpuLoras: 24, maxModelLen: 256, maxNumSeqs: 4}}
"""
ADAPTER = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{pool: lead, source: {{path: /adapters/a1}}}}
"""


@pytest.fixture(scope="module")
def helm() -> str:
    built = subprocess.run([str(REPO / "e2e" / "helm" / "build.sh")], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def two_operators(cluster, helm):
    """The chart's defaults (2 replicas, leader election, the release namespace watched and nothing else
    granted) in a fresh namespace, which holds the pools too. Yields (pools namespace, operator namespace): the
    same one."""
    namespace = f"kl-lead-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    kube = ["--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace]
    install = subprocess.run([helm, "install", RELEASE, str(REPO / "charts" / "kubelora"), *kube,
                              "--set", "operator.resyncSeconds=2", "--set", "operator.backoffMaxSeconds=4"],
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    try:
        wait_for("2 operator replicas available", lambda: cluster.get_json(
            "deployment", RELEASE, "-n", namespace)["status"].get("availableReplicas") == 2,
            timeout_s=120)
        yield namespace, namespace
    finally:
        _delete_kubelora_objects(cluster, namespace)
        subprocess.run([helm, "uninstall", RELEASE, *kube, "--wait", "--timeout", "60s"], capture_output=True,
                       timeout=90)
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=90s", check=False,
                        timeout_s=120)


def can_i(cluster, service_account: str, verb: str, resource: str, namespace: str | None) -> str:
    """`kubectl auth can-i` as the operator's ServiceAccount: "yes" or "no"."""
    scope = ["-n", namespace] if namespace else ["--all-namespaces"]
    result = cluster.kubectl("auth", "can-i", f"--as={service_account}", verb, resource, *scope, check=False)
    return result.stdout.strip()


def test_the_default_install_grants_nothing_outside_its_namespace(cluster, two_operators) -> None:
    """No path to kube-system: the default chart cannot create workloads (which could run as any ServiceAccount
    there) nor read Secrets outside the release namespace; in it, it can do its work."""
    namespace, _ = two_operators
    operator = f"system:serviceaccount:{namespace}:{RELEASE}"
    for verb, resource, where in (("create", "deployments", "kube-system"), ("patch", "deployments", "kube-system"),
                                  ("get", "secrets", "kube-system"), ("create", "pods", "kube-system"),
                                  ("create", "rolebindings", "kube-system"), ("get", "secrets", "default"),
                                  ("create", "deployments", None), ("get", "secrets", None)):
        assert can_i(cluster, operator, verb, resource, where) == "no", (verb, resource, where)
    for verb, resource in (("create", "deployments"), ("get", "secrets"), ("create", "secrets"),
                           ("patch", "lorapools.kubelora.io/status")):
        assert can_i(cluster, operator, verb, resource, namespace) == "yes", (verb, resource)
    assert can_i(cluster, operator, "list", "secrets", namespace) == "yes"  # tenant API key Secrets, by label
    assert can_i(cluster, operator, "list", "secrets", "kube-system") == "no"
    assert can_i(cluster, operator, "watch", "secrets", namespace) == "no"
    assert can_i(cluster, operator, "list", "namespaces", None) == "yes"  # kopf's discovery, read-only


def holder(cluster, operator_namespace: str) -> str | None:
    return cluster.get_json("lease", RELEASE, "-n", operator_namespace)["spec"].get("holderIdentity")


def operator_pods(cluster, operator_namespace: str) -> dict[str, dict]:
    items = cluster.get_json("pods", "-n", operator_namespace, "-l", "app.kubernetes.io/component=operator")["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def load_calls(cluster, namespace: str) -> Counter:
    """adapter -> load calls the engine pod of `lead` answered (its JSON log lines)."""
    calls: Counter = Counter()
    pods = cluster.get_json("pods", "-n", namespace, "-l", "kubelora.io/pool=lead,app.kubernetes.io/component=engine")
    for pod in pods["items"]:
        for line in cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"]).stdout.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") in ("adapter_loaded", "adapter_load_failed"):
                calls[record["adapter"]] += 1
    return calls


def test_the_standby_takes_over_when_the_leader_is_killed(cluster, two_operators, material) -> None:
    namespace, operator_namespace = two_operators
    leader = wait_for("a Lease holder", lambda: holder(cluster, operator_namespace), timeout_s=30)
    pods = operator_pods(cluster, operator_namespace)
    leader_pod = leader.rsplit("_", 1)[0]
    [standby_pod] = set(pods) - {leader_pod}
    cluster.kubectl("create", "secret", "generic", "engine-admin", "-n", namespace, "--from-literal=token=e2e-lead")
    cluster.apply(POOL.format(models=material.model_dir.parent, adapters=material.adapters_dir), namespace=namespace)
    wait_for("the engine pod Ready", lambda: cluster.get_json("lorapool", "lead", "-n", namespace)
             .get("status", {}).get("readyReplicas") == 1, timeout_s=180)

    names = [f"t{i:02d}" for i in range(NUM_ADAPTERS)]
    for name in names[:KILL_AFTER]:
        cluster.apply(ADAPTER.format(name=name), namespace=namespace)
    os.kill(cluster.container_pid(pods[leader_pod]["metadata"]["uid"], "operator"), signal.SIGKILL)
    killed_at = time.monotonic()
    for name in names[KILL_AFTER:]:
        cluster.apply(ADAPTER.format(name=name), namespace=namespace)

    new_leader = wait_for("a new Lease holder", lambda: (h := holder(cluster, operator_namespace)) != leader and h,
                          timeout_s=TAKEOVER_S + 5, interval_s=0.2)
    took_s = time.monotonic() - killed_at
    print(f"[leader-e2e] {leader} killed; {new_leader} took the Lease after {took_s:.1f}s")
    assert took_s <= TAKEOVER_S
    assert new_leader.rsplit("_", 1)[0] == standby_pod  # the restarted container is a new candidate, and later

    def all_ready() -> bool:
        items = cluster.get_json("loraadapters", "-n", namespace)["items"]
        return sum(a.get("status", {}).get("phase") == "Ready" for a in items) == NUM_ADAPTERS

    wait_for(f"all {NUM_ADAPTERS} adapters Ready", all_ready, timeout_s=90)
    print(f"[leader-e2e] all Ready {time.monotonic() - killed_at:.1f}s after the kill")
    calls = load_calls(cluster, namespace)
    assert calls == Counter(dict.fromkeys(names, 1)), f"engine load calls per adapter: {dict(calls)}"
    # The killed replica came back as a standby: two pods Ready, the Lease still with the new leader.
    wait_for("the killed replica back", lambda: cluster.get_json("deployment", RELEASE, "-n", operator_namespace)
             ["status"].get("availableReplicas") == 2, timeout_s=90)
    assert holder(cluster, operator_namespace) == new_leader

    # A rollout (SIGTERM to the leader) hands over at once: the leader releases the Lease on its way out, so the
    # next holder acquires it a retry period after the leader's last renewal, not a lease duration (10 s) later.
    last_renewed = None

    def handed_over() -> dict | None:
        nonlocal last_renewed
        spec = cluster.get_json("lease", RELEASE, "-n", operator_namespace)["spec"]
        if spec.get("holderIdentity") == new_leader:
            last_renewed = spec["renewTime"]
            return None
        return spec if spec.get("holderIdentity") else None

    handed_over()
    cluster.kubectl("delete", "pod", standby_pod, "-n", operator_namespace, "--wait=false")
    deleted_at = time.monotonic()
    spec = wait_for("the Lease handed over", handed_over, timeout_s=30, interval_s=0.2)
    handover_s = time.monotonic() - deleted_at
    gap_s = (dt.datetime.fromisoformat(spec["acquireTime"]) - dt.datetime.fromisoformat(last_renewed)).total_seconds()
    print(f"[leader-e2e] deleted the leader's pod; {spec['holderIdentity']} holds the Lease "
          f"{handover_s:.1f}s later, acquired {gap_s:.1f}s after the last renewal seen")
    assert gap_s < 5
    # The SIGTERM reaches the pod within the kubelet's 1 s sync; kopf's watchers and daemons stop within 2 s,
    # its cleanup handler releases the Lease, and the standby takes it at its next 1 s retry: kopf's own exit,
    # which may wait 5 s more, is not waited for.
    assert handover_s < 5
