"""`python -m localkubelet --node-name ... `: wiring only."""
from __future__ import annotations

import logging
import signal
import subprocess
import threading

from . import network
from .apiclient import ApiClient
from .config import parse_args
from .imagestore import ImageStore
from .logserver import serve
from .manager import PodManager
from .node import NodeAgent
from .podworker import WorkerDeps

SHUTDOWN_GRACE_S = 10.0


def remove_stale_namespaces() -> None:
    """Pods of a previous kubelet run are restarted from scratch; free their names first."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith("klr-"):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            for pid in pids.stdout.split():
                subprocess.run(["kill", "-KILL", pid], capture_output=True)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def remove_stale_containers() -> None:
    """runc containers of a previous kubelet run (their ids start with the pod's namespace name)."""
    listed = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout
    for container_id in listed.split():
        if container_id.startswith("klr-"):
            subprocess.run(["runc", "delete", "--force", container_id], capture_output=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    cfg = parse_args()
    api = ApiClient(cfg.apiserver, cfg.identity)
    remove_stale_namespaces()
    remove_stale_containers()
    images = ImageStore(cfg.image_dirs, cfg.image_cache_dir)
    images.prune()
    cfg.pods_dir.mkdir(parents=True, exist_ok=True)
    node = NodeAgent(cfg, api)
    node.register()
    node.start_heartbeat()
    manager = PodManager(cfg, WorkerDeps(cfg, api, network.IpAllocator(cfg.pod_cidr, cfg.node_ip), images))
    serve(cfg, manager)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logging.getLogger(__name__).info("kubelet for node %s ready", cfg.node_name)
    manager.run(stop)
    node.stop()
    manager.stop_all(SHUTDOWN_GRACE_S)


if __name__ == "__main__":
    main()
