"""The router's registry: upstream error series exist at 0 for the placement's replicas before any failure."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubelora.router.metrics import UPSTREAM_ERROR_KINDS, RouterMetrics, RouterSnapshot
from kubelora.router.placement import Placement, Replica


def placement(*pods: str) -> Placement:
    return Placement("p", "base", 1, tuple(Replica(pod, f"http://{pod}:8000", True) for pod in pods))


def upstream_errors(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    """(pod, kind) -> value of kubelora_router_upstream_errors_total, as a scrape reads it."""
    text = generate_latest(metrics.registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "kubelora_router_upstream_errors"]
    return {(s.labels["pod"], s.labels["kind"]): s.value for s in family.samples if s.name.endswith("_total")}


def test_every_replica_of_the_placement_has_each_kind_at_zero():
    metrics = RouterMetrics(lambda: RouterSnapshot(placement("e0", "e1"), {}, 0, 0.0))
    assert upstream_errors(metrics) == {(pod, kind): 0.0 for pod in ("e0", "e1") for kind in UPSTREAM_ERROR_KINDS}


def test_counted_failures_replace_the_zeros_and_outlive_the_placement():
    current = [placement("e0", "e1")]
    metrics = RouterMetrics(lambda: RouterSnapshot(current[0], {}, 0, 0.0))
    metrics.upstream_errors.labels("e0", "connect").inc()
    metrics.upstream_errors.labels("e0", "connect").inc()
    assert upstream_errors(metrics) == {("e0", "connect"): 2.0, ("e0", "broken"): 0.0,
                                        ("e1", "connect"): 0.0, ("e1", "broken"): 0.0}

    current[0] = placement("e2")  # a rollout: e0 and e1 left, e0's count stays, the zeros go
    assert upstream_errors(metrics) == {("e0", "connect"): 2.0, ("e2", "connect"): 0.0, ("e2", "broken"): 0.0}


def test_no_placement_no_series():
    metrics = RouterMetrics(lambda: RouterSnapshot(None, {}, 0, 0.0))
    assert upstream_errors(metrics) == {}
