"""`helm lint --strict` with the defaults and with each charts/kubelora/ci/*.yaml."""

from __future__ import annotations

import pytest

from .conftest import CHART, CI_VALUES, KUBE_VERSION, run_helm


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "defaults")
def test_lint(helm, values):
    args = ["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION]
    if values is not None:
        args += ["-f", str(values)]
    assert "0 chart(s) failed" in run_helm(helm, *args)
