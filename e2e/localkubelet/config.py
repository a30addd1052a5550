"""Kubelet settings, parsed once at the entry point."""
from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from .apiclient import TlsIdentity


@dataclass(frozen=True)
class KubeletConfig:
    node_name: str
    node_ip: str
    pod_cidr: str
    port: int
    apiserver: str
    apiserver_port: int
    identity: TlsIdentity
    serving_cert: str
    serving_key: str
    root_dir: Path
    num_fake_gpus: int
    # Directories of image archives (`make images`: build/images); containers run from them with runc.
    image_dirs: tuple[Path, ...]
    image_cache_dir: Path
    sync_period_s: float = 1.0
    heartbeat_period_s: float = 10.0
    lease_duration_s: int = 40
    # Real kubelets back off 10s doubling to 300s; tests want faster recovery.
    restart_backoff_base_s: float = 1.0
    restart_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if ipaddress.ip_address(self.node_ip) not in ipaddress.ip_network(self.pod_cidr):
            raise ValueError(f"node_ip {self.node_ip} must lie in pod_cidr {self.pod_cidr}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.num_fake_gpus < 0:
            raise ValueError(f"num_fake_gpus must be >= 0, got {self.num_fake_gpus}")
        if not self.image_dirs:
            raise ValueError("image_dirs: give at least one directory of image archives")
        if not 0 < self.restart_backoff_base_s <= self.restart_backoff_max_s:
            raise ValueError("restart_backoff_base_s must be in (0, restart_backoff_max_s]")

    @property
    def pods_dir(self) -> Path:
        return self.root_dir / "pods"

    @property
    def netns_record_dir(self) -> Path:
        """One empty file per pod network namespace this kubelet made (e2e/cluster down removes those only)."""
        return self.root_dir / "netns"


def parse_args(argv: list[str] | None = None) -> KubeletConfig:
    parser = argparse.ArgumentParser(prog="localkubelet")
    for flag in ("node-name", "node-ip", "pod-cidr", "apiserver", "ca", "client-cert",
                 "client-key", "serving-cert", "serving-key", "root-dir", "image-cache-dir"):
        parser.add_argument(f"--{flag}", required=True)
    parser.add_argument("--port", type=int, default=10250)
    parser.add_argument("--num-fake-gpus", type=int, default=0)
    parser.add_argument("--image-dir", action="append", required=True,
                        help="a directory of image archives (*.tar); repeatable")
    args = parser.parse_args(argv)
    return KubeletConfig(
        node_name=args.node_name, node_ip=args.node_ip, pod_cidr=args.pod_cidr, port=args.port,
        apiserver=args.apiserver, apiserver_port=int(args.apiserver.rsplit(":", 1)[1]),
        identity=TlsIdentity(args.ca, args.client_cert, args.client_key),
        serving_cert=args.serving_cert, serving_key=args.serving_key,
        root_dir=Path(args.root_dir),
        num_fake_gpus=args.num_fake_gpus, image_dirs=tuple(Path(d) for d in args.image_dir),
        image_cache_dir=Path(args.image_cache_dir),
    )
