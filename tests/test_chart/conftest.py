"""Chart test material: the helm binary (built by e2e/helm/build.sh, cached), promtool, rendering helpers, and the
`cluster` fixture of e2e/pytest_cluster.py for the install test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubelora"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
KUBE_VERSION = "1.36.3"  # the e2e cluster's release; the chart requires >= 1.30

# --import-mode=importlib and -P: e2e/ is not on sys.path by default.
sys.path.insert(0, str(REPO / "e2e"))
from pytest_cluster import cluster  # noqa: E402,F401  (a fixture, registered by import)


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of the helm binary; builds it on a fresh machine (minutes), finds it in the cache otherwise."""
    result = subprocess.run([str(REPO / "e2e" / "helm" / "build.sh")], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def promtool() -> str:
    """Debian's `prometheus` package provides it; .ci/run and `make test` (`make promtool`) install it when missing."""
    path = shutil.which("promtool")
    assert path, "promtool not found: apt-get install prometheus (as .ci/run and `make promtool` do)"
    return path


def run_helm(helm: str, *args: str, timeout_s: float = 120) -> str:
    result = subprocess.run([helm, *args], capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"helm {' '.join(args)}: {result.stderr}"
    return result.stdout


@pytest.fixture(scope="session")
def render(helm):
    """`render(values_file=None, *set_args, namespace="kubelora-system")` -> {(kind, name): manifest}."""

    def run(values: Path | None = None, *set_args: str, namespace: str = "kubelora-system") -> dict:
        args = ["template", "rel", str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
        if values is not None:
            args += ["-f", str(values)]
        for item in set_args:
            args += ["--set", item]
        docs = [d for d in yaml.safe_load_all(run_helm(helm, *args)) if d]
        rendered = {}
        for doc in docs:
            key = (doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace"))
            assert key not in rendered, f"rendered twice: {key}"
            rendered[key] = doc
        return rendered

    return run
