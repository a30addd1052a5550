"""Command lines and kubeconfigs of etcd, the control plane and the local kubelet."""
from __future__ import annotations

import sys
from pathlib import Path

from .config import E2E_DIR, REPO_DIR, ClusterConfig, cache_root
from .network import ClusterNetwork
from .procs import Daemon

IMAGE_DIR = REPO_DIR / "build" / "images"  # what `make images` writes


def apiserver_url(cfg: ClusterConfig, net: ClusterNetwork) -> str:
    return f"https://{net.bridge_ip}:{cfg.apiserver_port}"


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A kubeconfig that points at the pki files rather than embedding them."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: kubelora
  cluster:
    server: {server}
    certificate-authority: {pki / 'ca.crt'}
users:
- name: {user}
  user:
    client-certificate: {pki / f'{user}.crt'}
    client-key: {pki / f'{user}.key'}
contexts:
- name: kubelora
  context: {{cluster: kubelora, user: {user}}}
current-context: kubelora
""")


def write_kubeconfigs(cfg: ClusterConfig, net: ClusterNetwork) -> None:
    server = apiserver_url(cfg, net)
    for user in ("admin", "controller-manager", "scheduler", "kubelet"):
        target = cfg.kubeconfig if user == "admin" else cfg.state_dir / f"{user}.kubeconfig"
        write_kubeconfig(target, server, cfg.pki_dir, user)


def build_daemons(cfg: ClusterConfig, net: ClusterNetwork, bin_dir: Path) -> tuple[Daemon, ...]:
    """In start order: each needs the one before it to be up."""
    return (build_etcd(cfg, bin_dir), build_apiserver(cfg, net, bin_dir),
            build_controller_manager(cfg, net, bin_dir), build_scheduler(cfg, bin_dir),
            build_kubelet(cfg, net),
            build_provisioner(cfg, apiserver_url(cfg, net)))


def build_etcd(cfg: ClusterConfig, bin_dir: Path) -> Daemon:
    client = f"http://127.0.0.1:{cfg.etcd_client_port}"
    peer = f"http://127.0.0.1:{cfg.etcd_peer_port}"
    return Daemon("etcd", (
        str(bin_dir / "etcd"), "--name=kubelora", f"--data-dir={cfg.state_dir / 'etcd'}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kubelora={peer}", "--log-level=warn",
        # Throwaway test data: skip fsync-heavy behaviour that slows small disks.
        "--unsafe-no-fsync=true",
    ))


def build_apiserver(cfg: ClusterConfig, net: ClusterNetwork, bin_dir: Path) -> Daemon:
    pki = cfg.pki_dir
    return Daemon("kube-apiserver", (
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{cfg.etcd_client_port}",
        # Endpoints and EndpointSlices reject loopback, so advertise the bridge address.
        f"--advertise-address={net.bridge_ip}", f"--bind-address={net.bridge_ip}",
        f"--secure-port={cfg.apiserver_port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={net.service_cidr}",
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true", "--profiling=false", "--v=1",
    ))


def build_controller_manager(cfg: ClusterConfig, net: ClusterNetwork, bin_dir: Path) -> Daemon:
    pki = cfg.pki_dir
    kubeconfig = cfg.state_dir / "controller-manager.kubeconfig"
    return Daemon("kube-controller-manager", (
        str(bin_dir / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={cfg.controller_manager_port}",
        "--use-service-account-credentials=true", "--leader-elect=false",
        f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        f"--service-cluster-ip-range={net.service_cidr}", "--profiling=false", "--v=1",
    ))


def build_scheduler(cfg: ClusterConfig, bin_dir: Path) -> Daemon:
    kubeconfig = cfg.state_dir / "scheduler.kubeconfig"
    return Daemon("kube-scheduler", (
        str(bin_dir / "kube-scheduler"), f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={cfg.scheduler_port}",
        "--leader-elect=false", "--profiling=false", "--v=1",
    ))


def build_kubelet(cfg: ClusterConfig, net: ClusterNetwork) -> Daemon:
    """The Python kubelet runs on this interpreter with the standard library only."""
    pki = cfg.pki_dir
    return Daemon("kubelet", (
        sys.executable, "-P", "-m", "localkubelet",
        f"--node-name={cfg.node_name}", f"--node-ip={net.bridge_ip}",
        f"--pod-cidr={net.pod_cidr}", f"--port={cfg.kubelet_port}",
        f"--apiserver={apiserver_url(cfg, net)}", f"--ca={pki / 'ca.crt'}",
        f"--client-cert={pki / 'kubelet.crt'}", f"--client-key={pki / 'kubelet.key'}",
        f"--serving-cert={pki / 'kubelet-serving.crt'}",
        f"--serving-key={pki / 'kubelet-serving.key'}",
        f"--root-dir={cfg.state_dir / 'kubelet'}", f"--num-fake-gpus={cfg.num_fake_gpus}",
        # Pods run the images `make images` left in build/images, unpacked into the cache once each.
        f"--image-dir={IMAGE_DIR}", f"--image-cache-dir={cache_root() / 'images'}",
    ), env=(("PYTHONPATH", str(E2E_DIR)),))


def build_provisioner(cfg: ClusterConfig, server: str) -> Daemon:
    """Binds PVCs to directories. A separate process: it needs cluster-wide rights to create
    PersistentVolumes, which the kubelet's node identity rightly lacks."""
    pki = cfg.pki_dir
    return Daemon("local-provisioner", (
        sys.executable, "-P", "-m", "localkubelet.provisioner", f"--server={server}",
        f"--ca={pki / 'ca.crt'}", f"--client-cert={pki / 'admin.crt'}",
        f"--client-key={pki / 'admin.key'}", f"--root-dir={cfg.state_dir / 'volumes'}",
    ), env=(("PYTHONPATH", str(E2E_DIR)),))

