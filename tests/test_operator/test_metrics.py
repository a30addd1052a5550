"""The operator's metrics: what each recording call exposes, that a forgotten pool leaves no series, and that
the HTTP endpoint serves them."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from kubelora.operator.metrics import OperatorMetrics, serve


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: OperatorMetrics, name: str, **labels) -> float | None:
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


def status(phase: str, **conditions: bool) -> dict:
    return {"phase": phase, "conditions": [{"type": t, "status": str(v)} for t, v in conditions.items()]}


def test_passes_errors_and_durations_by_pool():
    m = OperatorMetrics()
    m.record_pass("ns", "p", 0.2, is_error=False)
    m.record_pass("ns", "p", 3.0, is_error=True)
    m.record_pass("ns", "q", 0.1, is_error=False)
    assert value(m, "kubelora_operator_reconcile_passes_total", namespace="ns", pool="p") == 2
    assert value(m, "kubelora_operator_reconcile_errors_total", namespace="ns", pool="p") == 1
    assert value(m, "kubelora_operator_reconcile_errors_total", namespace="ns", pool="q") == 0  # a series at once
    assert value(m, "kubelora_operator_reconcile_duration_seconds_sum", namespace="ns", pool="p") == pytest.approx(3.2)
    assert value(m, "kubelora_operator_reconcile_duration_seconds_bucket", namespace="ns", pool="p", le="1.0") == 1


def test_calls_placement_changes_phases_and_pool_conditions():
    m = OperatorMetrics()
    m.record_call("ns", "p", "load", is_error=False)
    m.record_call("ns", "p", "load", is_error=True)
    m.record_call("ns", "p", "unload", is_error=False)
    with pytest.raises(ValueError, match="call must be one of"):
        m.record_call("ns", "p", "reload", is_error=False)
    m.record_placement_change("ns", "p")
    m.record_adapters("ns", "p", [status("Ready"), status("Ready"), status("Failed", Stalled=True),
                                  status("Pending", Stalled=False)])
    m.record_pool("ns", "p", status("", Ready=True, Degraded=True, Stalled=False))
    calls = "kubelora_operator_engine_calls_total"
    assert value(m, calls, namespace="ns", pool="p", call="load", result="ok") == 1
    assert value(m, calls, namespace="ns", pool="p", call="load", result="error") == 1
    assert value(m, calls, namespace="ns", pool="p", call="unload", result="ok") == 1
    assert value(m, "kubelora_operator_placement_changes_total", namespace="ns", pool="p") == 1
    phases = {p: value(m, "kubelora_operator_adapters", namespace="ns", pool="p", phase=p)
              for p in ("Pending", "Loading", "Ready", "Degraded", "Failed")}
    assert phases == {"Pending": 1, "Loading": 0, "Ready": 2, "Degraded": 0, "Failed": 1}
    assert value(m, "kubelora_operator_adapters_stalled", namespace="ns", pool="p") == 1
    conditions = {c: value(m, "kubelora_operator_pool_condition", namespace="ns", pool="p", condition=c)
                  for c in ("Ready", "Degraded", "Stalled")}
    assert conditions == {"Ready": 1, "Degraded": 1, "Stalled": 0}
    # The next pass's counts replace the last ones (a gauge per phase, not a running total).
    m.record_adapters("ns", "p", [status("Ready")])
    assert value(m, "kubelora_operator_adapters", namespace="ns", pool="p", phase="Failed") == 0
    assert value(m, "kubelora_operator_adapters", namespace="ns", pool="p", phase="Ready") == 1


def test_a_forgotten_pool_leaves_no_series_and_others_stay():
    m = OperatorMetrics()
    for pool in ("p", "q"):
        m.record_pass("ns", pool, 0.1, is_error=True)
        m.record_call("ns", pool, "unload", is_error=True)
        m.record_placement_change("ns", pool)
        m.record_adapters("ns", pool, [status("Ready")])
        m.record_pool("ns", pool, status("", Ready=True))
    m.forget_pool("ns", "p")
    m.forget_pool("ns", "never-seen")
    pools = {dict(labels).get("pool") for (_, labels) in samples(m)}
    assert pools == {"q", None}  # None: kubelora_operator_leader, which has no pool


def test_leader_gauge_and_http_endpoint():
    m = OperatorMetrics()
    m.set_leader(False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve(port, m)
    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "kubelora_operator_leader 0.0" in scrape()
    m.set_leader(True)
    assert "kubelora_operator_leader 1.0" in scrape()
