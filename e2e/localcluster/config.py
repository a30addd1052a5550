"""Pinned versions and the on-disk layout of the local cluster."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Keep in step with e2e/k8s/go.mod (k8s.io/kubernetes and the v0.x.y staging pins).
KUBE_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")

E2E_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = E2E_DIR.parent
BUILD_MODULE_DIR = E2E_DIR / "k8s"


def cache_root() -> Path:
    """Outside the repo so a fresh clone (CI) reuses binaries built by an earlier run."""
    override = os.environ.get("KUBELORA_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "kubelora"


def bin_dir() -> Path:
    """Binaries are keyed by both versions: changing a pin never reuses stale binaries."""
    return cache_root() / "k8s" / f"{KUBE_VERSION}-etcd{ETCD_VERSION}" / "bin"


@dataclass(frozen=True)
class ClusterConfig:
    """Where the cluster keeps its state and which ports it binds.

    The API server binds the bridge address only; etcd and the controllers bind loopback.
    Ports are uncommon ones so a cluster can coexist with other services on the machine.
    """

    state_dir: Path
    node_name: str = "kubelora-node"
    apiserver_port: int = 16443
    etcd_client_port: int = 12379
    etcd_peer_port: int = 12380
    kubelet_port: int = 10250
    controller_manager_port: int = 10257
    scheduler_port: int = 10259
    num_fake_gpus: int = 4
    ready_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.num_fake_gpus < 0:
            raise ValueError(f"num_fake_gpus must be >= 0, got {self.num_fake_gpus}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def pid_dir(self) -> Path:
        return self.state_dir / "pids"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def network_file(self) -> Path:
        return self.state_dir / "network.json"

    @property
    def netns_record_dir(self) -> Path:
        """The kubelet records each pod network namespace it makes here (its --root-dir, then netns/)."""
        return self.state_dir / "kubelet" / "netns"

    @property
    def checkout_file(self) -> Path:
        """The checkout whose `up` started the running daemons (its build/images are what pods run)."""
        return self.state_dir / "checkout"


def default_config() -> ClusterConfig:
    state = os.environ.get("KUBELORA_CLUSTER_STATE", "/tmp/kubelora-cluster")
    gpus = int(os.environ.get("KUBELORA_FAKE_GPUS", "4"))
    return ClusterConfig(state_dir=Path(state), num_fake_gpus=gpus)
