"""`e2e/cluster up|down|status|kubeconfig`: entry point, wiring only."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time

from . import apicheck, build, components, network, pki, procs
from .config import ClusterConfig, default_config

# Reverse start order: the kubelet first, so it can stop its pods while the API is still up.
STOP_ORDER = ("local-provisioner", "kubelet", "kube-scheduler", "kube-controller-manager",
              "kube-apiserver", "etcd")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/cluster", description=__doc__)
    parser.add_argument("command", choices=("up", "down", "status", "kubeconfig", "build"))
    args = parser.parse_args(argv)
    cfg = default_config()
    if args.command == "build":
        build.ensure_binaries()
        return 0
    handlers = {"up": up, "down": down, "status": status, "kubeconfig": print_kubeconfig}
    return handlers[args.command](cfg)


def up(cfg: ClusterConfig) -> int:
    started = time.monotonic()
    bin_dir = build.ensure_binaries()
    if not any(procs.running_pid(name, cfg.pid_dir) for name in STOP_ORDER):
        # Nothing of ours runs (first start, reboot, crash): start from a clean slate so no
        # stale certificate, address or etcd data from an earlier cluster is reused.
        clean_up(cfg)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    net = network.ensure_network(cfg.network_file)
    pki.ensure_pki(cfg.pki_dir, pki.build_cert_specs(cfg.node_name, net.bridge_ip,
                                                     net.first_service_ip))
    components.write_kubeconfigs(cfg, net)
    server = components.apiserver_url(cfg, net)
    context = apicheck.admin_context(cfg.pki_dir)
    for daemon in components.build_daemons(cfg, net, bin_dir):
        pid = procs.start(daemon, cfg.pid_dir, cfg.log_dir)
        wait_for_daemon(cfg, daemon.name, pid, server, context)
    apicheck.wait_until(f"node {cfg.node_name} Ready",
                        lambda: apicheck.node_is_ready(server, cfg.node_name, context),
                        cfg.ready_timeout_s)
    apicheck.wait_until("namespace default usable",
                        lambda: apicheck.namespace_is_usable(server, "default", context),
                        cfg.ready_timeout_s)
    build.log(f"cluster up in {time.monotonic() - started:.1f}s; kubectl: {bin_dir / 'kubectl'}")
    if not any(components.IMAGE_DIR.glob("*.tar")):
        build.log(f"no image archives in {components.IMAGE_DIR}: pods will wait with ErrImageNeverPull "
                  "until `make images` has built them")
    print(cfg.kubeconfig)
    return 0


def wait_for_daemon(cfg: ClusterConfig, name: str, pid: int, server: str, context) -> None:
    """Block until a component serves, so the next one starts against a working API."""
    checks = {
        "etcd": lambda: apicheck.get_ok(f"http://127.0.0.1:{cfg.etcd_client_port}/health"),
        "kube-apiserver": lambda: apicheck.get_ok(f"{server}/readyz", context),
    }
    check = checks.get(name)
    if check is not None:
        apicheck.wait_until(name, check, cfg.ready_timeout_s, lambda: procs.is_alive(pid))


def down(cfg: ClusterConfig) -> int:
    for name in STOP_ORDER:
        procs.stop(name, cfg.pid_dir, grace_s=35.0 if name == "kubelet" else 10.0)
    clean_up(cfg)
    build.log("cluster down: processes stopped, pod namespaces, veths and bridge removed")
    return 0


def clean_up(cfg: ClusterConfig) -> None:
    """Remove everything but the daemons: containers, pod networking, state."""
    kill_leftover_containers()
    network.remove_pod_networking()
    shutil.rmtree(cfg.state_dir, ignore_errors=True)


def kill_leftover_containers() -> None:
    """runc containers whose kubelet died (their ids start with their pod's namespace name, `klr-`)."""
    if shutil.which("runc") is None:
        return
    listed = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout
    for container_id in listed.split():
        if container_id.startswith("klr-"):
            subprocess.run(["runc", "delete", "--force", container_id], capture_output=True)


def status(cfg: ClusterConfig) -> int:
    is_up = True
    for name in reversed(STOP_ORDER):
        pid = procs.running_pid(name, cfg.pid_dir)
        is_up &= pid is not None
        print(f"{name:24} {'running pid ' + str(pid) if pid else 'stopped'}")
    has_bridge = network.link_exists(network.BRIDGE)
    print(f"{'bridge ' + network.BRIDGE:24} {'present' if has_bridge else 'absent'}")
    print(f"{'kubeconfig':24} {cfg.kubeconfig}")
    return 0 if is_up else 1


def print_kubeconfig(cfg: ClusterConfig) -> int:
    print(cfg.kubeconfig)
    return 0 if cfg.kubeconfig.exists() else 1


if __name__ == "__main__":
    sys.exit(main())
