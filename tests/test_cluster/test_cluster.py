"""The local control plane and kubelet behave like a cluster.

A Deployment of a small HTTP server scales 1 -> 3 -> 1; pods get distinct IPs on the
bridge, become Ready through their probes, show up in the Service's EndpointSlices, answer
on their pod IPs, survive a killed process, and work with `kubectl get -o wide` / `logs`.
"""
from __future__ import annotations

import json
import os
import signal
import urllib.request
import uuid
from pathlib import Path

import pytest
from pytest_cluster import LocalCluster, wait_for

# On a fresh machine the first test also pays for building the control plane (minutes):
# allow for it beyond the suite-wide pytest-timeout (CI runs `e2e/cluster build` first).
pytestmark = pytest.mark.timeout(1800)

ECHO_SERVER = Path(__file__).with_name("echo_server.py")
APP = "echo"
PORT = 8080


def build_manifests(namespace: str) -> list[dict]:
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "echo"},
              "data": {"greeting": "hello from a configmap",
                       "server.py": ECHO_SERVER.read_text()}}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "echo"},
              "stringData": {"password": "s3cret"}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": APP},
               "spec": {"selector": {"app": APP},
                        "ports": [{"port": 80, "targetPort": "http"}]}}
    return [config, secret, service, build_deployment(replicas=1)]


def build_deployment(replicas: int) -> dict:
    field = lambda path: {"fieldRef": {"fieldPath": path}}  # noqa: E731
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1}
    container = {
        "name": "server", "image": "kubelora-base:bookworm",
        "command": ["python3", "/opt/echo/server.py"],
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": [{"name": "POD_NAME", "valueFrom": field("metadata.name")},
                {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
                {"name": "POD_IP", "valueFrom": field("status.podIP")},
                {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "echo",
                                                                       "key": "greeting"}}},
                {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "echo",
                                                                    "key": "password"}}}],
        "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 5},
        "volumeMounts": [{"name": "code", "mountPath": "/opt/echo", "readOnly": True},
                         {"name": "code", "mountPath": "/etc/echo", "readOnly": True}],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": APP},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": APP}},
                     "template": {"metadata": {"labels": {"app": APP}},
                                  "spec": {"containers": [container],
                                           "terminationGracePeriodSeconds": 5,
                                           "volumes": [{"name": "code",
                                                        "configMap": {"name": "echo"}}]}}}}


@pytest.fixture(scope="module")
def namespace(cluster: LocalCluster):
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    wait_for("default service account", lambda: cluster.kubectl(
        "get", "-n", name, "serviceaccount/default", check=False).returncode == 0)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def ready_pods(cluster: LocalCluster, namespace: str) -> list[dict]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", f"app={APP}")["items"]
    return [p for p in pods if p["metadata"].get("deletionTimestamp") is None
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions", []))]


def wait_ready(cluster: LocalCluster, namespace: str, count: int) -> list[dict]:
    def check() -> list[dict] | None:
        pods = cluster.get_json("pods", "-n", namespace, "-l", f"app={APP}")["items"]
        ready = ready_pods(cluster, namespace)
        return ready if len(ready) == count == len(pods) else None
    return wait_for(f"{count} ready {APP} pods and no others", check, timeout_s=120)


def endpoint_ips(cluster: LocalCluster, namespace: str) -> set[str]:
    slices = cluster.get_json("endpointslices", "-n", namespace,
                              "-l", f"kubernetes.io/service-name={APP}")["items"]
    return {address for s in slices for e in (s.get("endpoints") or [])
            if e.get("conditions", {}).get("ready") for address in e["addresses"]}


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def scale(cluster: LocalCluster, namespace: str, replicas: int) -> list[dict]:
    cluster.kubectl("scale", "-n", namespace, f"deployment/{APP}", f"--replicas={replicas}")
    pods = wait_ready(cluster, namespace, replicas)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == replicas, f"pod IPs are not distinct: {ips}"
    wait_for(f"EndpointSlices listing {ips}", lambda: endpoint_ips(cluster, namespace) == ips)
    return pods


def test_deployment_scales_serves_and_heals(cluster: LocalCluster, namespace: str) -> None:
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List",
                              "items": build_manifests(namespace)}), namespace)
    (first,) = scale(cluster, namespace, 1)
    seen = get(f"http://{first['status']['podIP']}:{PORT}/whoami")
    assert seen == {"pod": first["metadata"]["name"], "namespace": namespace,
                    "pod_ip": first["status"]["podIP"], "greeting": "hello from a configmap",
                    "password": "s3cret", "config_file": "hello from a configmap",
                    "sa_namespace": namespace}
    identity = get(f"http://{first['status']['podIP']}:{PORT}/whoami/api")
    assert identity["username"] == f"system:serviceaccount:{namespace}:default"

    pods = scale(cluster, namespace, 3)
    for pod in pods:  # same port in every pod, each reached on its own IP
        answer = get(f"http://{pod['status']['podIP']}:{PORT}/whoami")
        assert answer["pod"] == pod["metadata"]["name"]

    check_killed_process_restarts(cluster, namespace, pods[0])
    check_deleted_pod_is_replaced(cluster, namespace, pods[1])
    check_kubectl_views(cluster, namespace)

    remaining = scale(cluster, namespace, 1)
    assert len(remaining) == 1


def check_killed_process_restarts(cluster: LocalCluster, namespace: str, pod: dict) -> None:
    name, uid, ip = pod["metadata"]["name"], pod["metadata"]["uid"], pod["status"]["podIP"]
    os.kill(cluster.container_pid(uid, "server"), signal.SIGKILL)

    def restarted() -> dict | None:
        current = cluster.get_json("pod", "-n", namespace, name)
        status = current["status"]["containerStatuses"][0]
        return current if status["restartCount"] >= 1 and status["ready"] else None
    current = wait_for(f"{name} restarted by the kubelet", restarted)
    last = current["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 128 + signal.SIGKILL
    assert current["status"]["podIP"] == ip
    assert get(f"http://{ip}:{PORT}/whoami")["pod"] == name
    wait_ready(cluster, namespace, 3)


def check_deleted_pod_is_replaced(cluster: LocalCluster, namespace: str, pod: dict) -> None:
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    pid = cluster.container_pid(uid, "server")
    cluster.kubectl("delete", "pod", "-n", namespace, name, "--wait=true", timeout_s=90)
    assert not Path(f"/proc/{pid}").exists(), "the deleted pod's process still runs"
    pods = wait_ready(cluster, namespace, 3)
    assert name not in {p["metadata"]["name"] for p in pods}
    wait_for("EndpointSlices follow the replacement",
             lambda: endpoint_ips(cluster, namespace) == {p["status"]["podIP"] for p in pods})


def check_kubectl_views(cluster: LocalCluster, namespace: str) -> None:
    pods = ready_pods(cluster, namespace)
    wide = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout
    for pod in pods:
        line = next(row for row in wide.splitlines() if row.startswith(pod["metadata"]["name"]))
        assert pod["status"]["podIP"] in line and "Running" in line
        assert pod["spec"]["nodeName"] in line
    name = pods[0]["metadata"]["name"]
    logs = cluster.kubectl("logs", "-n", namespace, name).stdout
    assert f"echo server {name} listening" in logs
    assert "GET /healthz" in logs


def test_pod_exit_codes_and_claims(cluster: LocalCluster, namespace: str) -> None:
    """A Never-restarting pod that writes to a PVC and fails reports Failed with its code."""
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
             "spec": {"accessModes": ["ReadWriteOnce"],
                      "resources": {"requests": {"storage": "1Gi"}}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "writer"},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "main", "image": "kubelora-base:bookworm",
               "command": ["sh", "-c", "echo written > /data/out.txt; echo bye; exit 3"],
               "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
               "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}}
    cluster.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": [claim, pod]}),
                  namespace)
    failed = wait_for("writer Failed", lambda: (lambda p: p if p["status"].get("phase") ==
                                                "Failed" else None)(
        cluster.get_json("pod", "-n", namespace, "writer")))
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    volume = cluster.get_json("pvc", "-n", namespace, "data")["spec"]["volumeName"]
    path = Path(cluster.get_json("pv", volume)["spec"]["hostPath"]["path"])
    assert (path / "out.txt").read_text() == "written\n"
    assert "bye" in cluster.kubectl("logs", "-n", namespace, "writer").stdout
