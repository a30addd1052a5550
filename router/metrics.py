"""Router metrics on a private registry (`GET /metrics`).

Counters are incremented as requests pass; gauges (in-flight per replica, placement) are read from the router's
state at scrape time, so a replica that left the placement disappears from the next scrape. The upstream error
counter is also 0 for every replica of the placement that has not failed yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kubelora.router.placement import Placement

UPSTREAM_ERROR_KINDS = ("connect", "broken")  # the kinds proxy.py counts


class RouterMetrics:
    def __init__(self, state: Callable[[], RouterSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kubelora_router_requests", "requests routed to a replica (retries not counted)",
                                ["model", "pod", "decision"], registry=self.registry)
        self.rejected = Counter("kubelora_router_rejected_requests", "requests answered by the router itself",
                                ["code"], registry=self.registry)
        self.key_refusals = Counter("kubelora_router_key_refusals", "requests refused on their API key: 401 (no valid "
                                    "key), 403 (a model the key may not call), 429 (over its rates), by the "
                                    "model asked for (\"other\": one the pool does not serve); never by key",
                                    ["model", "status"], registry=self.registry)
        # (model, status) -> refusals since start: what GET /placement reports to the operator (its events)
        self.key_refusal_totals: dict[tuple[str, str], int] = {}
        self.upstream_errors = Counter("kubelora_router_upstream_errors",
                                       "replica failures: connect (retried on the next replica) or broken (after "
                                       "the first byte; the client sees the error)", ["pod", "kind"],
                                       registry=None)  # registered below, with its zeros
        self.retries = Counter("kubelora_router_retries", "requests sent again to the next replica",
                               registry=self.registry)
        self.duration = Histogram("kubelora_router_request_duration_seconds",
                                  "from the request to the end of the replica's answer, by decision",
                                  ["decision"], registry=self.registry,
                                  buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.registry.register(_StateCollector(state))
        self.registry.register(_UpstreamErrorsWithZeros(self.upstream_errors, state))

    def refuse_key(self, model: str, status: int) -> None:
        self.key_refusals.labels(model, str(status)).inc()
        key = (model, str(status))
        self.key_refusal_totals[key] = self.key_refusal_totals.get(key, 0) + 1


@dataclass(frozen=True)
class RouterSnapshot:
    """The router's state at scrape time."""
    placement: Placement | None
    in_flight: Mapping[str, int]  # pod -> requests in flight
    num_read_failures: int
    placement_age_s: float  # since a read last confirmed the placement (since start while none has)


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], RouterSnapshot]) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self._state()
        placement, in_flight, num_errors = snapshot.placement, snapshot.in_flight, snapshot.num_read_failures
        pods = {r.pod for r in placement.replicas} if placement else set()
        busy = GaugeMetricFamily("kubelora_router_in_flight", "requests in flight per replica", labels=["pod"])
        for pod in sorted(pods | {p for p, n in in_flight.items() if n}):
            busy.add_metric([pod], in_flight.get(pod, 0))
        yield busy
        yield GaugeMetricFamily("kubelora_router_placement_revision", "revision of the placement routed on "
                                "(-1: none loaded)", value=placement.revision if placement else -1)
        replicas = GaugeMetricFamily("kubelora_router_placement_replicas", "replicas in the placement",
                                     labels=["ready"])
        num_ready = len(placement.ready_replicas()) if placement else 0
        replicas.add_metric(["true"], num_ready)
        replicas.add_metric(["false"], (len(placement.replicas) if placement else 0) - num_ready)
        yield replicas
        yield GaugeMetricFamily("kubelora_router_placement_adapters", "adapters in the placement",
                                value=len(placement.adapters) if placement else 0)
        yield GaugeMetricFamily("kubelora_router_placement_age_seconds", "seconds since a placement read last "
                                "succeeded (since start while none has): how stale the placement may be",
                                value=snapshot.placement_age_s)
        yield CounterMetricFamily("kubelora_router_placement_read_failures",
                                  "placement reads or parses that failed (one per outage)", value=num_errors)


class _UpstreamErrorsWithZeros(Collector):
    """The upstream error counter with a 0 for each kind on every replica of the placement routed on that has not
    failed yet: dashboards and rates see a series before a replica's first failure. A replica that left the
    placement keeps only the series it counted (pod names change with every rollout)."""

    def __init__(self, counter: Counter, state: Callable[[], RouterSnapshot]) -> None:
        self._counter = counter
        self._state = state

    def collect(self) -> Iterator[Metric]:
        placement = self._state().placement
        pods = sorted({r.pod for r in placement.replicas}) if placement else []
        (family,) = self._counter.collect()
        counted = {(s.labels["pod"], s.labels["kind"]) for s in family.samples}
        for pod in pods:
            for kind in UPSTREAM_ERROR_KINDS:
                if (pod, kind) not in counted:
                    family.add_sample(family.name + "_total", {"pod": pod, "kind": kind}, 0.0)
        yield family
