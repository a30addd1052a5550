"""`e2e/cluster up|down|status|kubeconfig`: entry point, wiring only."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import apicheck, build, components, network, pki, procs
from .config import REPO_DIR, ClusterConfig, default_config
from .errors import ClusterError, describe_exit

# Reverse start order: the kubelet first, so it can stop its pods while the API is still up.
STOP_ORDER = ("local-provisioner", "kubelet", "kube-scheduler", "kube-controller-manager",
              "kube-apiserver", "etcd")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/cluster", description=__doc__)
    parser.add_argument("command", choices=("up", "down", "status", "kubeconfig", "build"))
    args = parser.parse_args(argv)
    cfg = default_config()
    handlers = {"up": up, "down": down, "status": status, "kubeconfig": print_kubeconfig, "build": build_only}
    try:
        return handlers[args.command](cfg)
    except ClusterError as error:  # a message that names what failed and where its log is, no traceback
        build.log(f"{args.command} failed: {error}")
        return 1


def build_only(cfg: ClusterConfig) -> int:
    build.ensure_binaries()
    return 0


def up(cfg: ClusterConfig) -> int:
    started = time.monotonic()
    bin_dir = build.ensure_binaries()
    if not any(procs.running_pid(name, cfg.pid_dir) for name in STOP_ORDER):
        # Nothing of ours runs (first start, reboot, crash): start from a clean slate so no
        # stale certificate, address or etcd data from an earlier cluster is reused.
        clean_up(cfg)
    else:
        refuse_other_checkout(cfg)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    cfg.checkout_file.write_text(f"{REPO_DIR}\n")
    net = network.ensure_network(cfg.network_file)
    pki.ensure_pki(cfg.pki_dir, pki.build_cert_specs(cfg.node_name, net.bridge_ip,
                                                     net.first_service_ip))
    components.write_kubeconfigs(cfg, net)
    server = components.apiserver_url(cfg, net)
    context = apicheck.admin_context(cfg.pki_dir)
    for daemon in components.build_daemons(cfg, net, bin_dir):
        start_daemon(cfg, daemon, server, context)
    apicheck.wait_until(f"node {cfg.node_name} Ready",
                        lambda: apicheck.node_is_ready(server, cfg.node_name, context),
                        cfg.ready_timeout_s, log_path=cfg.log_dir / "kubelet.log")
    apicheck.wait_until("namespace default usable",
                        lambda: apicheck.namespace_is_usable(server, "default", context),
                        cfg.ready_timeout_s, log_path=cfg.log_dir / "kube-controller-manager.log")
    build.log(f"cluster up in {time.monotonic() - started:.1f}s; kubectl: {bin_dir / 'kubectl'}")
    if not any(components.IMAGE_DIR.glob("*.tar")):
        build.log(f"no image archives in {components.IMAGE_DIR}: pods will wait with ErrImageNeverPull "
                  "until `make images` has built them")
    print(cfg.kubeconfig)
    return 0


def refuse_other_checkout(cfg: ClusterConfig) -> None:
    """The running daemons were started from another checkout: its kubelet runs that checkout's images, so
    adopting the cluster would test other code (state dir and ports are per machine: one cluster at a time)."""
    if not cfg.checkout_file.exists():
        return  # started before checkouts were recorded: adopted, and recorded as ours from now on
    other = Path(cfg.checkout_file.read_text().strip())
    if other != REPO_DIR:
        raise ClusterError(
            f"a cluster started from another checkout ({other}) is running with state in {cfg.state_dir}; its "
            f"pods run that checkout's images. Stop it with `{other / 'e2e' / 'cluster'} down` (or wait until its "
            "tests end), or give this one its own KUBELORA_CLUSTER_STATE once the other is down")


def start_daemon(cfg: ClusterConfig, daemon: procs.Daemon, server: str, context) -> None:
    """Start `daemon`, or adopt the running one, and wait until it serves. A running kube-apiserver that is
    shutting down (a SIGTERM just before `up`) is waited for and replaced instead of adopted; one that dies
    while `up` waits for it is started again once."""
    adopted = procs.running_pid(daemon.name, cfg.pid_dir)
    if adopted is not None and daemon.name == "kube-apiserver" and apicheck.is_shutting_down(server, context):
        build.log(f"kube-apiserver (pid {adopted}) is shutting down: waiting for it to exit, then starting a new one")
        if not procs.wait_exited(adopted, timeout_s=cfg.ready_timeout_s):
            raise ClusterError(f"kube-apiserver (pid {adopted}) still shutting down after {cfg.ready_timeout_s:.0f}s; "
                               f"its log: {cfg.log_dir / 'kube-apiserver.log'}")
        adopted = None
    pid = procs.start(daemon, cfg.pid_dir, cfg.log_dir)
    try:
        wait_for_daemon(cfg, daemon.name, pid, server, context)
    except ClusterError:
        if adopted is None or procs.is_alive(pid):
            raise
        build.log(f"{daemon.name} (pid {pid}, running before `up`) exited while up waited for it: starting a new one")
        pid = procs.start(daemon, cfg.pid_dir, cfg.log_dir)
        wait_for_daemon(cfg, daemon.name, pid, server, context)


def wait_for_daemon(cfg: ClusterConfig, name: str, pid: int, server: str, context) -> None:
    """Block until a component serves, so the next one starts against a working API."""
    checks = {
        "etcd": lambda: apicheck.get_ok(f"http://127.0.0.1:{cfg.etcd_client_port}/health"),
        "kube-apiserver": lambda: apicheck.get_ok(f"{server}/readyz", context),
    }
    log_path = cfg.log_dir / f"{name}.log"
    check = checks.get(name)
    if check is not None:
        apicheck.wait_until(name, check, cfg.ready_timeout_s, lambda: procs.is_alive(pid), log_path=log_path)
    elif not procs.is_alive(pid):
        raise ClusterError(describe_exit(name, pid, log_path))


def down(cfg: ClusterConfig) -> int:
    for name in STOP_ORDER:
        procs.stop(name, cfg.pid_dir, grace_s=35.0 if name == "kubelet" else 10.0)
    clean_up(cfg)
    build.log("cluster down: processes stopped, pod namespaces, veths and bridge removed")
    return 0


def clean_up(cfg: ClusterConfig) -> None:
    """Remove everything but the daemons: containers, pod networking, state; only what this cluster made."""
    kill_leftover_containers(network.recorded_netns(cfg.netns_record_dir))
    network.remove_pod_networking(cfg.netns_record_dir, cfg.network_file)
    shutil.rmtree(cfg.state_dir, ignore_errors=True)


def kill_leftover_containers(netns_names: list[str]) -> None:
    """runc containers whose kubelet died: their ids start with their pod's namespace name and a dash."""
    if shutil.which("runc") is None or not netns_names:
        return
    listed = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout
    prefixes = tuple(f"{name}-" for name in netns_names)
    for container_id in listed.split():
        if container_id.startswith(prefixes):
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
