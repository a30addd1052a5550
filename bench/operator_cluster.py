"""The operator benchmark's own control plane: etcd and kube-apiserver, nothing else.

Built from e2e/localcluster (the pinned binaries it builds and caches under ~/.cache/kubelora/k8s, its
certificates and its etcd and kube-apiserver command lines), in the bench's temporary directory, on free ports,
bound to 127.0.0.1. So a local cluster other tests use (/tmp/kubelora-cluster) is never touched, and the bench's
load shares no API server with them. There is no controller-manager, scheduler or kubelet: the bench makes the
engine and router pods itself (operator_kube.py) and nothing garbage-collects.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kubelora.operator.kube import KubeConnection

REPO_DIR = Path(__file__).resolve().parents[1]
E2E_DIR = REPO_DIR / "e2e"
CRD_DIR = REPO_DIR / "crds"
START_TIMEOUT_S = 120.0
DAEMONS = ("etcd", "kube-apiserver")


def _localcluster():
    """e2e/localcluster, which a checkout has (this benchmark runs from one, as the e2e tests do)."""
    if not (E2E_DIR / "localcluster").is_dir():
        raise RuntimeError(f"kubelora bench operator needs the repository checkout's e2e/ ({E2E_DIR} is missing)")
    if str(E2E_DIR) not in sys.path:
        sys.path.insert(0, str(E2E_DIR))
    import localcluster

    return localcluster


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ControlPlane:
    state_dir: Path
    server: str  # https://127.0.0.1:PORT
    kubeconfig: Path  # the admin's (system:masters), certificate files by path
    kubectl_path: Path
    kube_version: str

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    def connection(self) -> KubeConnection:
        context = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        context.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        return KubeConnection(self.server, context, {})

    def kubectl(self, *args: str, timeout_s: float = 60) -> str:
        result = subprocess.run([str(self.kubectl_path), *args], capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)})
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def install_crds(self) -> None:
        """Apply the CRDs; return once both kinds can be listed (Established comes before the storage is ready, and
        kopf's first list would wait a retry for it)."""
        self.kubectl("apply", "-f", str(CRD_DIR))
        self.kubectl("wait", "--for=condition=Established", "crd/lorapools.kubelora.io",
                     "crd/loraadapters.kubelora.io", "--timeout=60s", timeout_s=70)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.kubectl("get", "lorapools,loraadapters", "-A")
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def cpu_pids(self) -> dict[str, int]:
        """Daemon name -> pid, for CPU readings."""
        procs = _localcluster().procs
        return {name: pid for name in DAEMONS if (pid := procs.running_pid(name, self.state_dir / "pids"))}

    def stop(self) -> None:
        procs = _localcluster().procs
        for name in reversed(DAEMONS):
            procs.stop(name, self.state_dir / "pids")


def start_control_plane(state_dir: Path) -> ControlPlane:
    """etcd and kube-apiserver on free loopback ports, their state under `state_dir`; returns once /readyz is 200."""
    _localcluster()
    from localcluster import apicheck, build, components, pki, procs
    from localcluster.config import KUBE_VERSION, ClusterConfig
    from localcluster.errors import ClusterError
    from localcluster.network import ClusterNetwork

    cfg = ClusterConfig(state_dir=state_dir, apiserver_port=free_port(), etcd_client_port=free_port(),
                        etcd_peer_port=free_port(), ready_timeout_s=START_TIMEOUT_S)
    # The service range is only allocated from (nothing routes it); 127.0.0.1 is the advertised address, which the
    # `kubernetes` Service's Endpoints would refuse: no endpoint reconciler.
    net = ClusterNetwork(pod_cidr="10.254.0.0/24", service_cidr="10.254.1.0/24", bridge_ip="127.0.0.1")
    bin_dir = build.ensure_binaries()
    pki.ensure_pki(cfg.pki_dir, pki.build_cert_specs("kubelora-bench", net.bridge_ip, net.first_service_ip))
    server = components.apiserver_url(cfg, net)
    components.write_kubeconfig(cfg.kubeconfig, server, cfg.pki_dir, "admin")
    apiserver = components.build_apiserver(cfg, net, bin_dir)
    apiserver = dataclasses.replace(apiserver, argv=(*apiserver.argv, "--endpoint-reconciler-type=none"))
    plane = ControlPlane(state_dir, server, cfg.kubeconfig, bin_dir / "kubectl", KUBE_VERSION)
    context = apicheck.admin_context(cfg.pki_dir)
    checks = ((components.build_etcd(cfg, bin_dir), f"http://127.0.0.1:{cfg.etcd_client_port}/health", None),
              (apiserver, f"{server}/readyz", context))
    try:
        for daemon, url, ssl_context in checks:
            pid = procs.start(daemon, cfg.pid_dir, cfg.log_dir)
            apicheck.wait_until(daemon.name, lambda: apicheck.get_ok(url, ssl_context), START_TIMEOUT_S,
                                lambda: procs.is_alive(pid), log_path=cfg.log_dir / f"{daemon.name}.log")
    except (ClusterError, OSError):
        plane.stop()
        raise
    return plane
