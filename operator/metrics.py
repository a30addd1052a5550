"""The operator's Prometheus metrics, on a private registry served by `serve` (kopf has no metrics server).

One recording API, `OperatorMetrics`; the reconcile tells it what a pass did (metered.py) and the entry point
whether this replica leads (cli.py). Series are labelled by the pool's namespace and name and dropped when the
pool's daemon stops (`forget_pool`), so a deleted pool leaves no stale gauges. A standby serves the same
endpoint with `kubelora_operator_leader 0` and no pool series: it acts on nothing.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.process_collector import ProcessCollector

POOL_LABELS = ("namespace", "pool")
PHASES = ("Pending", "Loading", "Ready", "Degraded", "Failed")  # status.Phase, the CRD's enum
POOL_CONDITIONS = ("Ready", "Degraded", "Stalled")
CALLS = ("load", "unload")
PASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.leader = Gauge("kubelora_operator_leader", "1 while this replica leads and acts, 0 while it stands by",
                            registry=r)
        self.passes = Counter("kubelora_operator_reconcile_passes", "reconcile passes run", POOL_LABELS, registry=r)
        self.whole_passes = Counter("kubelora_operator_reconcile_whole_passes", "reconcile passes that read every "
                                    "adapter and every engine's model list and decided over the whole pool (the "
                                    "others decided for changed adapters only)", POOL_LABELS, registry=r)
        self.errors = Counter("kubelora_operator_reconcile_errors", "reconcile passes that raised (retried at the "
                              "next trigger or resync)", POOL_LABELS, registry=r)
        self.duration = Histogram("kubelora_operator_reconcile_duration_seconds", "one reconcile pass, start to end",
                                  POOL_LABELS, buckets=PASS_BUCKETS, registry=r)
        self.calls = Counter("kubelora_operator_engine_calls", "adapter loads and unloads issued to engine pods, "
                             "by outcome (ok, error)", (*POOL_LABELS, "call", "result"), registry=r)
        self.placement_changes = Counter("kubelora_operator_placement_changes",
                                         "placements published with a new revision", POOL_LABELS, registry=r)
        self.adapters = Gauge("kubelora_operator_adapters", "the pool's adapters by phase (as the last pass "
                              "wrote them)", (*POOL_LABELS, "phase"), registry=r)
        self.adapters_stalled = Gauge("kubelora_operator_adapters_stalled", "the pool's adapters whose Stalled "
                                      "condition is True", POOL_LABELS, registry=r)
        self.pool_condition = Gauge("kubelora_operator_pool_condition", "1 while the pool's condition is True",
                                    (*POOL_LABELS, "condition"), registry=r)

    def set_leader(self, is_leader: bool) -> None:
        self.leader.set(1 if is_leader else 0)

    def record_pass(self, namespace: str, pool: str, duration_s: float, is_error: bool) -> None:
        self.passes.labels(namespace, pool).inc()
        self.whole_passes.labels(namespace, pool)  # 0 until one runs
        self.duration.labels(namespace, pool).observe(duration_s)
        errors = self.errors.labels(namespace, pool)  # from the first pass on, 0 until one fails (dashboards, rates)
        if is_error:
            errors.inc()

    def record_call(self, namespace: str, pool: str, call: str, is_error: bool) -> None:
        """call: "load" or "unload"."""
        if call not in CALLS:
            raise ValueError(f"call must be one of {CALLS}, got {call!r}")
        self.calls.labels(namespace, pool, call, "error" if is_error else "ok").inc()

    def record_whole_pass(self, namespace: str, pool: str) -> None:
        self.whole_passes.labels(namespace, pool).inc()

    def record_placement_change(self, namespace: str, pool: str) -> None:
        self.placement_changes.labels(namespace, pool).inc()

    def record_adapters(self, namespace: str, pool: str, statuses: Iterable[Mapping]) -> None:
        """statuses: every adapter's status as the last pass that decided for it computed it (`status` of a
        LoRAAdapter): phase and conditions."""
        statuses = list(statuses)
        phases = Tally(s.get("phase") for s in statuses)
        for phase in PHASES:
            self.adapters.labels(namespace, pool, phase).set(phases.get(phase, 0))
        self.adapters_stalled.labels(namespace, pool).set(sum(_is_true(s, "Stalled") for s in statuses))

    def record_pool(self, namespace: str, pool: str, status: Mapping) -> None:
        """status: the pool's status as the pass writes it."""
        for condition in POOL_CONDITIONS:
            self.pool_condition.labels(namespace, pool, condition).set(1 if _is_true(status, condition) else 0)

    def forget_pool(self, namespace: str, pool: str) -> None:
        """Drop the pool's series (its daemon stopped: the pool is deleted, or this replica stopped leading)."""
        for metric, extra in ((self.passes, ()), (self.whole_passes, ()), (self.errors, ()), (self.duration, ()),
                              (self.placement_changes, ()), (self.adapters_stalled, ()),
                              (self.adapters, [(p,) for p in PHASES]),
                              (self.pool_condition, [(c,) for c in POOL_CONDITIONS]),
                              (self.calls, [(c, r) for c in CALLS for r in ("ok", "error")])):
            for rest in extra or [()]:
                try:
                    metric.remove(namespace, pool, *rest)
                except KeyError:  # never recorded
                    pass


def _is_true(status: Mapping, condition: str) -> bool:
    return any(c.get("type") == condition and c.get("status") == "True" for c in status.get("conditions") or ())


def build_default() -> OperatorMetrics:
    """The process's metrics, with the process collector (CPU, memory, open files)."""
    metrics = OperatorMetrics()
    ProcessCollector(registry=metrics.registry)
    return metrics


METRICS = build_default()


def serve(port: int, metrics: OperatorMetrics = METRICS) -> None:
    """`GET http://0.0.0.0:port/metrics` from a daemon thread, for the life of the process."""
    start_http_server(port, registry=metrics.registry)
