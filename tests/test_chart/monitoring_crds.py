"""prometheus-operator's CRDs on the e2e API server (e2e/prometheus-operator-crds.sh fetches and caches them), for the
tests that create or dry-run the chart's monitoring objects. Applied when a module starts and left installed, as Helm
leaves CRDs: test sessions may share the cluster, and deleting a CRD deletes every object of its kind, another
session's included."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .conftest import REPO

CRDS = ("servicemonitors.monitoring.coreos.com", "podmonitors.monitoring.coreos.com",
        "prometheusrules.monitoring.coreos.com")


def crd_dir() -> Path:
    result = subprocess.run([str(REPO / "e2e" / "prometheus-operator-crds.sh")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def install_monitoring_crds(cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(crd_dir()))
    cluster.kubectl("wait", "--for=condition=Established", *(f"crd/{crd}" for crd in CRDS), "--timeout=60s")
