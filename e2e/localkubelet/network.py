"""Per-pod network namespaces on the cluster bridge (see e2e/localcluster/network.py).

Each pod gets `klr-<id>` with `eth0` (its pod IP) and `lo`; the host end `klrv<id>` of the
veth pair is a port of the bridge. No default route: pods reach the node, and so the API
server, at the bridge address, and each other on the pod subnet.
"""
from __future__ import annotations

import ipaddress
import subprocess
import threading
from pathlib import Path

BRIDGE = "klr-br0"


def netns_name(pod_uid: str) -> str:
    return "klr-" + pod_uid.replace("-", "")[:10]


def veth_name(pod_uid: str) -> str:
    return "klrv" + pod_uid.replace("-", "")[:10]  # 14 chars: Linux allows 15


class IpAllocator:
    """Hands out pod IPs round-robin, so a deleted pod's address is not reused at once
    (EndpointSlices and clients may still hold it for a moment)."""

    def __init__(self, pod_cidr: str, node_ip: str) -> None:
        network = ipaddress.ip_network(pod_cidr)
        self._pool = [str(h) for h in network.hosts() if str(h) != node_ip]
        self._prefixlen = network.prefixlen
        self._used: set[str] = set()
        self._next = 0
        self._lock = threading.Lock()

    @property
    def prefixlen(self) -> int:
        return self._prefixlen

    def allocate(self, wanted: str = "") -> str:
        """`wanted`, when it is a free address of the pool (the IP the API already records for the pod: a pod
        whose sandbox is set up again keeps it, since the API refuses to change a pod's IPs); else the next
        free one."""
        with self._lock:
            if wanted in self._pool and wanted not in self._used:
                self._used.add(wanted)
                return wanted
            for offset in range(len(self._pool)):
                candidate = self._pool[(self._next + offset) % len(self._pool)]
                if candidate not in self._used:
                    self._used.add(candidate)
                    self._next = (self._next + offset + 1) % len(self._pool)
                    return candidate
        raise RuntimeError("pod CIDR exhausted")

    def release(self, address: str) -> None:
        with self._lock:
            self._used.discard(address)


def create_pod_netns(pod_uid: str, address: str, prefixlen: int, record_dir: Path) -> str:
    """Create the namespace and wire it to the bridge; returns the namespace name. Each namespace this kubelet
    makes is recorded in `record_dir` first (an empty file named after it), so that cleaning up removes these
    and never another cluster's or tool's `klr-*` namespaces."""
    netns, veth = netns_name(pod_uid), veth_name(pod_uid)
    delete_pod_netns(pod_uid, record_dir)  # a leftover from a crashed kubelet would block the names
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / netns).touch()
    run("ip", "netns", "add", netns)
    run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
    run("ip", "link", "set", veth, "master", BRIDGE, "up")
    run("ip", "-n", netns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
    run("ip", "-n", netns, "link", "set", "eth0", "up")
    run("ip", "-n", netns, "link", "set", "lo", "up")
    return netns


def delete_pod_netns(pod_uid: str, record_dir: Path) -> None:
    """Kill anything still inside, then delete the namespace (which takes the veth along)."""
    delete_netns(netns_name(pod_uid))
    (record_dir / netns_name(pod_uid)).unlink(missing_ok=True)


def delete_netns(netns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    for pid in pids.stdout.split():
        subprocess.run(["kill", "-KILL", pid], capture_output=True)
    subprocess.run(["ip", "netns", "delete", netns], capture_output=True)
    subprocess.run(["ip", "link", "delete", "klrv" + netns.removeprefix("klr-")], capture_output=True)


def recorded_netns(record_dir: Path) -> list[str]:
    """The namespaces this kubelet made and has not deleted yet (across its restarts)."""
    return sorted(p.name for p in record_dir.glob("klr-*")) if record_dir.is_dir() else []


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)
