"""pytest plugin: a session-scoped `cluster` fixture backed by `e2e/cluster`.

Load it from a conftest with `pytest_plugins = ["pytest_cluster"]` after putting e2e/ on
sys.path (tests run with --import-mode=importlib and the repo root is not importable).
The cluster is started once per session and always stopped at the end, unless it was
already up before the session (then it is left as found).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

E2E_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(E2E_DIR))

from localcluster import config, network  # noqa: E402

CLUSTER = E2E_DIR / "cluster"


@dataclass(frozen=True)
class LocalCluster:
    kubeconfig: Path
    kubectl_path: Path
    state_dir: Path

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                timeout_s: float = 60) -> subprocess.CompletedProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        result = subprocess.run([str(self.kubectl_path), *args], input=stdin, text=True,
                                capture_output=True, env=env, timeout=timeout_s)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def apply(self, manifest: str, namespace: str | None = None) -> None:
        scope = ("-n", namespace) if namespace else ()
        self.kubectl("apply", *scope, "-f", "-", stdin=manifest)

    def container_pid(self, pod_uid: str, container: str) -> int:
        """Host pid of a running container process (the kubelet records it)."""
        pid_file = self.state_dir / "kubelet" / "pods" / pod_uid / "containers" / f"{container}.pid"
        return int(pid_file.read_text().split()[0])


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 90.0,
             interval_s: float = 0.5) -> Any:
    """Poll until `check` returns something truthy; return it."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, OSError, KeyError, ValueError) as error:
            last_error = error
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}"
                         + (f" (last error: {last_error})" if last_error else ""))


def run_cluster(command: str, timeout_s: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", str(CLUSTER), command], text=True,
                          stdout=subprocess.PIPE, timeout=timeout_s)


@functools.cache  # once per session: every test folder's conftest imports the cluster fixture
def ensure_images() -> None:
    """Pods run the images of this checkout: `make images` (a second or so when nothing changed, minutes after
    a code change; its progress goes to stderr), so that a direct pytest run never tests stale images."""
    started = time.monotonic()
    built = subprocess.run(["bash", str(E2E_DIR.parent / "images" / "build.sh")], stdout=sys.stderr)
    assert built.returncode == 0, "images/build.sh failed (see its output above)"
    print(f"[cluster] images checked/built in {time.monotonic() - started:.1f}s", file=sys.stderr)


def leftovers(netns_names: list[str]) -> list[str]:
    """What of the cluster is still on the machine after `down`: the pod namespaces its kubelet made
    (`netns_names`, read before `down`), their veths, its bridge."""
    present = set(network.list_netns())
    found = [f"netns {name}" for name in netns_names if name in present]
    veths = {network.VETH_PREFIX + name.removeprefix(network.NETNS_PREFIX) for name in netns_names}
    found += [f"link {link['ifname']}" for link in network.ip_json("link")
              if link["ifname"] in veths or link["ifname"] == network.BRIDGE]
    return found


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network namespaces, bind mounts)")
    if shutil.which("ip") is None or shutil.which("openssl") is None:
        pytest.fail("the local cluster needs iproute2 and openssl "
                    "(apt-get install iproute2 openssl)")
    ensure_images()
    was_up = run_cluster("status").returncode == 0
    started = time.monotonic()
    up = run_cluster("up")
    print(f"\n[cluster] up took {time.monotonic() - started:.1f}s", file=sys.stderr)
    try:
        assert up.returncode == 0, "e2e/cluster up failed (see its stderr above)"
        kubeconfig = Path(up.stdout.strip().splitlines()[-1])
        yield LocalCluster(kubeconfig, config.bin_dir() / "kubectl",
                           config.default_config().state_dir)
    finally:
        if not was_up:
            created = network.recorded_netns(config.default_config().netns_record_dir)
            run_cluster("down")
            remaining = leftovers(created)
            assert not remaining, f"e2e/cluster down left {remaining}"
