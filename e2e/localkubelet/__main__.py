"""`python -m localkubelet --node-name ... `: wiring only."""
from __future__ import annotations

import logging
import signal
import subprocess
import threading

from . import network
from .apiclient import ApiClient
from .config import KubeletConfig, parse_args
from .imagestore import ImageStore
from .logserver import serve
from .manager import PodManager
from .node import NodeAgent
from .podworker import WorkerDeps

SHUTDOWN_GRACE_S = 10.0


def remove_stale_namespaces(cfg: KubeletConfig) -> list[str]:
    """Pods of a previous run of this kubelet are restarted from scratch: free the names of the namespaces it
    recorded (only those: other `klr-*` namespaces on the machine are not ours). Returns their names."""
    names = network.recorded_netns(cfg.netns_record_dir)
    for name in names:
        network.delete_netns(name)
        (cfg.netns_record_dir / name).unlink(missing_ok=True)
    return names


def remove_stale_containers(netns_names: list[str]) -> None:
    """runc containers of a previous run (their ids start with their pod's namespace name and a dash)."""
    if not netns_names:
        return
    listed = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout
    for container_id in listed.split():
        if container_id.startswith(tuple(f"{name}-" for name in netns_names)):
            subprocess.run(["runc", "delete", "--force", container_id], capture_output=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    cfg = parse_args()
    api = ApiClient(cfg.apiserver, cfg.identity)
    remove_stale_containers(remove_stale_namespaces(cfg))
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
