"""crds/ is the only hand-edited copy of each CRD: the chart's copies must be byte-identical
(run charts/sync-crds.sh after editing crds/)."""

from __future__ import annotations

from .conftest import CHART, REPO


def test_chart_crds_equal_the_source():
    source = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert source, "no CRDs in crds/"
    assert sorted(chart) == sorted(source), "the chart's CRD files differ from crds/: run charts/sync-crds.sh"
    for name, data in source.items():
        assert chart[name] == data, f"charts/kubelora/crds/{name} differs from crds/{name}: run charts/sync-crds.sh"
