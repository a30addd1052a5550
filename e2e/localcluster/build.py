"""Build the pinned control-plane binaries once per version and reuse them after."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from . import config
from .errors import ClusterError, tail

GO = "/usr/local/go/bin/go"


def has_all_binaries(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in config.BINARIES)


def ensure_binaries() -> Path:
    """Return the cached bin dir, building it first if any binary is missing.

    Prints how long the check or the build took: CI budgets on the cold build.
    """
    started = time.monotonic()
    bin_dir = config.bin_dir()
    if has_all_binaries(bin_dir):
        log(f"binaries cached in {bin_dir} (checked in {time.monotonic() - started:.2f}s)")
        return bin_dir
    log(f"building Kubernetes {config.KUBE_VERSION} + etcd {config.ETCD_VERSION} ({', '.join(config.BINARIES)}) "
        f"from source into {bin_dir}: about 10 minutes on 2 cores the first time, cached after")
    run_build(bin_dir)
    log(f"build finished in {time.monotonic() - started:.0f}s")
    return bin_dir


PROGRESS_EVERY_S = 30.0


def run_build(bin_dir: Path) -> None:
    """e2e/k8s/build.sh, its output in a log beside the binaries; a line of progress every PROGRESS_EVERY_S, and
    on failure the package that failed (go prints `# <package>` above its errors) and the log."""
    if not os.access(GO, os.X_OK):
        raise ClusterError(f"{GO} not found: the control plane is built from source with Go >= 1.26")
    bin_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = bin_dir.parent / "build.log"
    env = dict(os.environ, KUBE_VERSION=config.KUBE_VERSION)
    script = config.BUILD_MODULE_DIR / "build.sh"
    started = time.monotonic()
    with open(log_path, "wb") as out:
        process = subprocess.Popen(["bash", str(script), str(bin_dir)], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while True:
            try:
                code = process.wait(timeout=PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                log(f"still building the control plane: {format_elapsed(time.monotonic() - started)} so far "
                    f"(log: {log_path})")
    if code != 0:
        failed = failed_packages(log_path)
        what = f"go build of {', '.join(failed)}" if failed else "e2e/k8s/build.sh"
        raise ClusterError(f"building the control plane failed after {format_elapsed(time.monotonic() - started)}:"
                           f" {what} (exit {code}); log: {log_path}; last lines:\n{tail(log_path)}")


def failed_packages(log_path: Path) -> list[str]:
    lines = log_path.read_text(errors="replace").splitlines()
    return [line[2:].strip() for line in lines if line.startswith("# ")]


def format_elapsed(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


def log(message: str) -> None:
    # stdout is reserved for the kubeconfig path, which `up` prints as its last line.
    print(f"[cluster] {message}", file=sys.stderr, flush=True)
