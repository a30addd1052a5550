"""The local cluster's own lifecycle: the kubelet re-asserts pod status that others overwrote, `up`
replaces an API server that is shutting down and refuses a cluster another checkout started, `down` removes only
the network namespaces this cluster's kubelet made, and failures name the component and its log.

The cluster tests use the session's real control plane (run them under `flock /tmp/kubelora-cluster.lock`);
the cleanup test needs root and iproute2 only.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from pytest_cluster import CLUSTER, E2E_DIR, LocalCluster, wait_for

from localcluster import apicheck, build, errors, network  # e2e/ is on sys.path (conftest)

pytestmark = pytest.mark.timeout(600)
APP = "steady"


def build_pod(name: str) -> dict:
    probe = {"exec": {"command": ["true"]}, "periodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": APP}},
            "spec": {"terminationGracePeriodSeconds": 2,
                     "containers": [{"name": "sleeper", "image": "kubelora-base:bookworm",
                                     "command": ["sleep", "3600"], "readinessProbe": probe}]}}


@pytest.fixture(scope="module")
def ready_pod(cluster: LocalCluster):
    """(namespace, pod name) of a Ready pod."""
    namespace = f"e2e-life-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    wait_for("default service account", lambda: cluster.kubectl(
        "get", "-n", namespace, "serviceaccount/default", check=False).returncode == 0)
    cluster.apply(json.dumps(build_pod("steady")), namespace=namespace)
    wait_for("pod Ready", lambda: is_ready(cluster, namespace, "steady"), timeout_s=120)
    yield namespace, "steady"
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def is_ready(cluster: LocalCluster, namespace: str, name: str) -> bool:
    pod = cluster.get_json("pod", name, "-n", namespace)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def mark_not_ready(cluster: LocalCluster, namespace: str, name: str) -> None:
    """What the node-lifecycle controller writes for the pods of a node it marked NotReady."""
    patch = {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NodeNotReady"},
                                       {"type": "ContainersReady", "status": "False", "reason": "NodeNotReady"}]}}
    cluster.kubectl("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=strategic",
                    "-p", json.dumps(patch))


def test_the_kubelet_reasserts_pod_status_others_overwrote(cluster: LocalCluster, ready_pod) -> None:
    namespace, name = ready_pod
    mark_not_ready(cluster, namespace, name)
    started = time.monotonic()
    wait_for("the kubelet's Ready back", lambda: is_ready(cluster, namespace, name), timeout_s=10, interval_s=0.2)
    assert time.monotonic() - started < 5  # listed every second, written again at once


def pid_of(cluster: LocalCluster, daemon: str) -> int:
    return int((cluster.state_dir / "pids" / f"{daemon}.pid").read_text().split()[0])


def test_up_right_after_a_sigterm_replaces_the_apiserver(cluster: LocalCluster, ready_pod) -> None:
    namespace, name = ready_pod
    old = pid_of(cluster, "kube-apiserver")
    os.kill(old, signal.SIGTERM)
    up = subprocess.run([sys.executable, "-P", str(CLUSTER), "up"], capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    print("".join(f"[lifecycle] {line}\n" for line in up.stderr.splitlines() if "kube-apiserver" in line))
    assert pid_of(cluster, "kube-apiserver") != old
    assert "Traceback" not in up.stderr
    # The API is back and the pod's status is the kubelet's, whatever was written meanwhile.
    mark_not_ready(cluster, namespace, name)
    wait_for("the kubelet's Ready back after the restart", lambda: is_ready(cluster, namespace, name), timeout_s=10)


def test_up_refuses_a_cluster_started_from_another_checkout(cluster: LocalCluster, tmp_path: Path) -> None:
    other_e2e = tmp_path / "other-checkout" / "e2e"  # what `up` runs: the script and its two packages
    for package in ("localcluster", "localkubelet"):
        shutil.copytree(E2E_DIR / package, other_e2e / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(E2E_DIR / "cluster", other_e2e / "cluster")
    up = subprocess.run([sys.executable, "-P", str(other_e2e / "cluster"), "up"], capture_output=True, text=True,
                        timeout=120)
    assert up.returncode == 1
    assert "another checkout" in up.stderr and str(E2E_DIR.parent) in up.stderr and "Traceback" not in up.stderr
    assert (cluster.state_dir / "checkout").read_text().strip() == str(E2E_DIR.parent)  # still this one's
    assert cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"


def test_pod_networking_cleanup_removes_only_recorded_namespaces(tmp_path: Path) -> None:
    ours, foreign = f"klr-t{uuid.uuid4().hex[:9]}", f"klr-t{uuid.uuid4().hex[:9]}"
    records = tmp_path / "kubelet" / "netns"
    records.mkdir(parents=True)
    try:
        for name in (ours, foreign):
            subprocess.run(["ip", "netns", "add", name], check=True)
        (records / ours).touch()
        network.remove_pod_networking(records, tmp_path / "network.json")  # no network.json: no bridge of ours
        present = network.list_netns()
        assert ours not in present and foreign in present
    finally:
        for name in (ours, foreign):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_a_failed_start_names_the_component_and_its_log(tmp_path: Path) -> None:
    log_path = tmp_path / "kube-apiserver.log"
    log_path.write_text("".join(f"line {i}\n" for i in range(30)) + "E0101 bind: address already in use\n")
    with pytest.raises(errors.ClusterError) as failed:
        apicheck.wait_until("kube-apiserver", lambda: False, 60, is_alive=lambda: False, log_path=log_path)
    message = str(failed.value)
    assert message.startswith("kube-apiserver exited during start-up; its log: " + str(log_path))
    assert "address already in use" in message and "line 29" in message and "line 5\n" not in message


def test_a_failed_build_names_the_package_and_its_log(tmp_path: Path, monkeypatch, capsys) -> None:
    """The control-plane build, with a stand-in build script that fails as `go build` does."""
    script = tmp_path / "build.sh"
    script.write_text("echo compiling; sleep 1.5; echo '# k8s.io/apiserver/pkg/server'; "
                      "echo 'server.go:1: undefined: x'; exit 1\n")
    monkeypatch.setattr(build.config, "BUILD_MODULE_DIR", tmp_path)
    monkeypatch.setattr(build, "GO", "/bin/true")
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.5)
    with pytest.raises(errors.ClusterError) as failed:
        build.run_build(tmp_path / "bin")
    message = str(failed.value)
    assert "go build of k8s.io/apiserver/pkg/server (exit 1)" in message
    assert str(tmp_path / "build.log") in message and "undefined: x" in message
    assert "still building the control plane" in capsys.readouterr().err  # progress while it ran


def test_the_cli_prints_a_failure_without_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "KUBELORA_CACHE": str(tmp_path / "cache"), "KUBELORA_CLUSTER_STATE": str(tmp_path / "s"),
           "PATH": "/usr/bin:/bin"}
    fake_go = tmp_path / "go"
    result = subprocess.run([sys.executable, "-P", "-c",
                             "import sys; sys.path.insert(0, sys.argv[1]); from localcluster import build, cli;"
                             f"build.GO = {str(fake_go)!r}; sys.exit(cli.main(['build']))", str(E2E_DIR)],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    assert f"build failed: {fake_go} not found" in result.stderr and "Traceback" not in result.stderr


def test_drift_is_the_phase_ip_or_a_condition_the_kubelet_wrote() -> None:
    from localkubelet.status import has_drifted

    written = {"phase": "Running", "podIP": "10.0.0.2",
               "conditions": [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}]}
    listed = {**written, "conditions": [*written["conditions"], {"type": "DisruptionTarget", "status": "True"}]}
    assert not has_drifted(written, listed)  # conditions others own do not count
    not_ready = {**listed, "conditions": [{"type": "Ready", "status": "False"}, {"type": "Initialized", "status": "True"}]}
    assert has_drifted(written, not_ready)
    assert has_drifted(written, {**listed, "phase": "Pending"})
    assert has_drifted(written, {**listed, "podIP": ""})
    assert has_drifted(written, {})
