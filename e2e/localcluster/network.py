"""The host side of pod networking: a bridge with no uplink, on a CIDR no route uses.

Pods (network namespaces made by the kubelet, see e2e/localkubelet/network.py) hang off this
bridge through veth pairs. The bridge is never enslaved to a real interface and pods get no
default route, so nothing can leave the machine.
"""
from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

BRIDGE = "klr-br0"
NETNS_PREFIX = "klr-"   # the kubelet names pod namespaces klr-<id>
VETH_PREFIX = "klrv"    # and host-side veths klrv<id>
# Each candidate /23 holds the pod /24 (lower half) and the service /24 (upper half).
CANDIDATE_BLOCKS = ("10.244.0.0/23", "10.213.0.0/23", "10.187.0.0/23", "172.29.250.0/23",
                    "192.168.231.0/23")


@dataclass(frozen=True)
class ClusterNetwork:
    pod_cidr: str        # e.g. 10.244.0.0/24; the bridge holds its first address
    service_cidr: str    # e.g. 10.244.1.0/24; ClusterIPs are allocated but never routed
    bridge_ip: str       # node InternalIP, API server advertise address

    @property
    def first_service_ip(self) -> str:
        return str(next(ipaddress.ip_network(self.service_cidr).hosts()))


def ensure_network(network_file: Path) -> ClusterNetwork:
    """Reuse the recorded network if its bridge still exists, else pick a free block."""
    if network_file.exists() and link_exists(BRIDGE):
        return ClusterNetwork(**json.loads(network_file.read_text()))
    if link_exists(BRIDGE):
        delete_bridge()  # left over by a crashed run whose state was removed
    network = choose_network(used_networks())
    create_bridge(network)
    network_file.write_text(json.dumps(asdict(network)))
    return network


def choose_network(used: list[ipaddress.IPv4Network]) -> ClusterNetwork:
    for block_text in CANDIDATE_BLOCKS:
        block = ipaddress.ip_network(block_text)
        if not any(block.overlaps(net) for net in used):
            pods, services = block.subnets(prefixlen_diff=1)
            bridge_ip = str(next(pods.hosts()))
            return ClusterNetwork(str(pods), str(services), bridge_ip)
    raise SystemExit(f"every candidate pod CIDR {CANDIDATE_BLOCKS} overlaps a route here")


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network a route (any table) or an address of this machine covers.

    The default route is skipped: it overlaps everything and only says where to send
    traffic for addresses nothing more specific claims.
    """
    used: list[ipaddress.IPv4Network] = []
    for route in ip_json("-4", "route", "show", "table", "all"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            used.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    for link in ip_json("-4", "addr"):
        for info in link.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False))
    return used


def create_bridge(network: ClusterNetwork) -> None:
    prefix = ipaddress.ip_network(network.pod_cidr).prefixlen
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{network.bridge_ip}/{prefix}", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")


def recorded_netns(record_dir: Path) -> list[str]:
    """The pod namespaces the kubelet of this cluster made (it records each in its state dir)."""
    return sorted(p.name for p in record_dir.glob(NETNS_PREFIX + "*")) if record_dir.is_dir() else []


def remove_pod_networking(record_dir: Path, network_file: Path) -> None:
    """Delete the pod namespaces and veths this cluster's kubelet made, then its bridge; nothing else, so other
    `klr-*` namespaces on the machine (another tool's, a cluster of another state dir) stay.

    Runs even when the kubelet died, so `down` always leaves the machine clean of this cluster.
    """
    for name in recorded_netns(record_dir):
        kill_netns_processes(name)
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
        veth = VETH_PREFIX + name.removeprefix(NETNS_PREFIX)
        if link_exists(veth):
            subprocess.run(["ip", "link", "delete", veth], check=False)
    if network_file.exists():  # the bridge is this cluster's: `up` recorded the network it made
        delete_bridge()


def kill_netns_processes(name: str) -> None:
    result = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    for pid in result.stdout.split():
        subprocess.run(["kill", "-KILL", pid], check=False, capture_output=True)


def delete_bridge() -> None:
    if link_exists(BRIDGE):
        subprocess.run(["ip", "link", "delete", BRIDGE], check=False)


def list_netns() -> list[str]:
    result = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True)
    return [entry["name"] for entry in json.loads(result.stdout or "[]")]


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def ip_json(*args: str) -> list[dict]:
    result = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True)
    return json.loads(result.stdout or "[]")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)
