"""The docs' dashboard pictures (kubelora.cli.dashboard_plots) name each line as the panel's legend format names it in
Grafana."""

from kubelora.cli.dashboard_plots import legend


def test_legend_fills_grafanas_label_references():
    labels = {"adapter": "t0", "tier": "host", "pod": "p-1"}
    assert legend("{{adapter}} {{tier}}", labels) == "t0 host"
    assert legend("{{ pod }} loads", labels) == "p-1 loads"
    assert legend("{{missing}} p99", labels) == " p99"
    assert legend("", labels) == "value"
