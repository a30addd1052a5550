"""Build the pinned control-plane binaries once per version and reuse them after."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from . import config

GO = "/usr/local/go/bin/go"


def has_all_binaries(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in config.BINARIES)


def ensure_binaries() -> Path:
    """Return the cached bin dir, building it first if any binary is missing.

    Prints how long the check or the build took: CI budgets on the cold build (issue 5).
    """
    started = time.monotonic()
    bin_dir = config.bin_dir()
    if has_all_binaries(bin_dir):
        log(f"binaries cached in {bin_dir} (checked in {time.monotonic() - started:.2f}s)")
        return bin_dir
    log(f"building Kubernetes {config.KUBE_VERSION} + etcd {config.ETCD_VERSION} into {bin_dir}")
    run_build(bin_dir)
    log(f"build finished in {time.monotonic() - started:.0f}s")
    return bin_dir


def run_build(bin_dir: Path) -> None:
    if not os.access(GO, os.X_OK):
        raise SystemExit(f"{GO} not found: the control plane is built from source with Go >= 1.26")
    bin_dir.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KUBE_VERSION=config.KUBE_VERSION)
    script = config.BUILD_MODULE_DIR / "build.sh"
    subprocess.run(["bash", str(script), str(bin_dir)], env=env, check=True, stdout=sys.stderr)


def log(message: str) -> None:
    # stdout is reserved for the kubeconfig path, which `up` prints as its last line.
    print(f"[cluster] {message}", file=sys.stderr, flush=True)
