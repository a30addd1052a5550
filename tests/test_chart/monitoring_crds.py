"""prometheus-operator's CRDs on the e2e API server (e2e/prometheus-operator-crds.sh fetches and caches them), for the
tests that create or dry-run the chart's monitoring objects. Installed for a module and removed after it, unless
they were there before."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .conftest import REPO

CRDS = ("servicemonitors.monitoring.coreos.com", "podmonitors.monitoring.coreos.com",
        "prometheusrules.monitoring.coreos.com")


def crd_dir() -> Path:
    result = subprocess.run([str(REPO / "e2e" / "prometheus-operator-crds.sh")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


@contextmanager
def monitoring_crds(cluster) -> Iterator[None]:
    present = cluster.kubectl("get", "crd", *CRDS, check=False).returncode == 0
    cluster.kubectl("apply", "--server-side", "-f", str(crd_dir()))
    cluster.kubectl("wait", "--for=condition=Established", *(f"crd/{crd}" for crd in CRDS), "--timeout=60s")
    try:
        yield
    finally:
        if not present:
            cluster.kubectl("delete", "crd", *CRDS, "--timeout=60s", check=False, timeout_s=90)
