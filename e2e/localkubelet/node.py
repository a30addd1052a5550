"""The Node object, its Lease and its Ready condition."""
from __future__ import annotations

import logging
import os
import platform
import threading

from .apiclient import STRATEGIC_PATCH, ApiClient, ApiError
from .config import KubeletConfig
from .timeutil import now_micro, now_rfc3339

KUBELET_VERSION = "v1.36.3"  # the pinned control-plane release (e2e/localcluster/config.py)
log = logging.getLogger(__name__)


def build_capacity(cfg: KubeletConfig) -> dict[str, str]:
    """Real CPU and memory; `nvidia.com/gpu` is advertised only, so GPU-requesting pods
    schedule here and run on CPU (docs/cluster.md)."""
    return {
        "cpu": str(os.cpu_count() or 1),
        "memory": f"{read_mem_total_kib()}Ki",
        "pods": "110",
        "ephemeral-storage": "100Gi",
        "nvidia.com/gpu": str(cfg.num_fake_gpus),
    }


def read_mem_total_kib() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    raise RuntimeError("MemTotal missing from /proc/meminfo")


def build_node(cfg: KubeletConfig) -> dict:
    labels = {"kubernetes.io/hostname": cfg.node_name, "kubernetes.io/os": "linux",
              "kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": "kubelora-local"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": cfg.node_name, "labels": labels},
            "spec": {"podCIDR": cfg.pod_cidr, "podCIDRs": [cfg.pod_cidr]}}


def build_node_status(cfg: KubeletConfig, transition_time: str) -> dict:
    capacity = build_capacity(cfg)
    now = now_rfc3339()
    ready = condition("Ready", "True", "KubeletReady", "local kubelet is posting ready status",
                      now, transition_time)
    pressures = [condition(kind, "False", f"KubeletHasSufficient{name}", f"no {name} pressure",
                           now, transition_time)
                 for kind, name in (("MemoryPressure", "Memory"), ("DiskPressure", "Disk"),
                                    ("PIDPressure", "PID"))]
    return {
        "capacity": capacity, "allocatable": capacity, "conditions": [ready, *pressures],
        "addresses": [{"type": "InternalIP", "address": cfg.node_ip},
                      {"type": "Hostname", "address": cfg.node_name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": cfg.port}},
        "nodeInfo": build_node_info(),
    }


def build_node_info() -> dict:
    uname = platform.uname()
    return {"machineID": "kubelora-local", "systemUUID": "kubelora-local",
            "bootID": read_boot_id(), "kernelVersion": uname.release,
            "osImage": "kubelora local kubelet (processes)", "operatingSystem": "linux",
            "architecture": "amd64", "containerRuntimeVersion": "kubelora-process://1",
            "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": ""}


def read_boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as boot_id:
        return boot_id.read().strip()


def condition(kind: str, status: str, reason: str, message: str, heartbeat: str,
              transition: str) -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": heartbeat, "lastTransitionTime": transition}


class NodeAgent:
    """Registers the node, then keeps its Lease and status fresh from a daemon thread."""

    def __init__(self, cfg: KubeletConfig, api: ApiClient) -> None:
        self._cfg = cfg
        self._api = api
        self._ready_since = now_rfc3339()
        self._stop = threading.Event()

    def register(self) -> None:
        try:
            self._api.post("/api/v1/nodes", build_node(self._cfg))
        except ApiError as error:
            if error.status != 409:
                raise
        self.post_status()
        self.renew_lease()

    def post_status(self) -> None:
        path = f"/api/v1/nodes/{self._cfg.node_name}/status"
        # Strategic merge: conditions merge by type, so others' conditions survive.
        self._api.patch(path, {"status": build_node_status(self._cfg, self._ready_since)},
                        STRATEGIC_PATCH)

    def renew_lease(self) -> None:
        leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        path = f"{leases}/{self._cfg.node_name}"
        spec = {"holderIdentity": self._cfg.node_name, "renewTime": now_micro(),
                "leaseDurationSeconds": self._cfg.lease_duration_s}
        try:
            self._api.patch(path, {"spec": spec})
        except ApiError as error:
            if error.status != 404:
                raise
            self._api.post(leases, {
                "metadata": {"name": self._cfg.node_name, "ownerReferences": [self.owner()]},
                "spec": spec})

    def owner(self) -> dict:
        node = self._api.get(f"/api/v1/nodes/{self._cfg.node_name}")
        return {"apiVersion": "v1", "kind": "Node", "name": self._cfg.node_name,
                "uid": node["metadata"]["uid"]}

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat, name="node-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._cfg.heartbeat_period_s):
            try:
                self.renew_lease()
                self.post_status()
            except (ApiError, OSError) as error:
                log.warning("node heartbeat failed: %s", error)
