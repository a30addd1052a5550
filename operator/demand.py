"""How many copies an adapter with `replicas: auto` gets: in proportion to its measured demand, within its bounds.

Pure: the reconcile hands in what the engines report and the time; it gets back each auto adapter's copies, why,
and the next memory.

- **Demand** is tokens per second: each engine's admin model list carries every adapter's `tokens_served` (prompt
  and generated tokens of its finished requests since the engine started), so measuring costs nothing beyond the
  pass's one GET per pod. The difference between two passes over the time between them, summed over pods, is
  smoothed with an exponential moving average of time constant `SMOOTHING_S` (a counter that went down is an
  engine that restarted: its new value is what it served since).
- **Copies** follow the adapter's share of the pool's demand: `ceil(pods x share x SPREAD)`, so an adapter with an
  eighth of the traffic is on every pod and the router's load bound spreads its requests over them, while cold
  adapters consolidate to their minimum. SPREAD is more than 1 because the router balances an adapter's requests
  among its holders only: with copies in plain proportion (SPREAD 1) every adapter under 1 / pods of the demand
  sits on one pod whatever that pod's load, and in the placement simulator (docs/benchmarks-placement.md) the
  busiest replica ran at 2.3x the mean; with 8 and the router's strict bound (load factor 1.0) it runs within the
  1.25x target, at a few more preloads. Bounds: `minReplicas` (default 1) and `maxReplicas` (default: every pod).
- **Hysteresis**, as the HPA does it: a rise is taken at once, a fall only once every recommendation of the last
  `SCALE_DOWN_WINDOW_S` is lower (the copies are the highest recommendation in that window).
- **Churn cap**: the copies added in one pass, over all auto adapters, are at most `MAX_LOADS_PER_POD_PER_MIN` per
  pod and minute since the last pass (hottest adapters first); the rest waits for the next passes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

SMOOTHING_S = 60.0
SCALE_DOWN_WINDOW_S = 300.0
MAX_LOADS_PER_POD_PER_MIN = 6
MIN_GAP_S = 0.5  # passes closer than this keep the previous rates (a counter difference over ~0 s means nothing)
SPREAD = 8  # copies per pod-share of demand (see the module doc)


@dataclass(frozen=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int | None = None  # None: every pod


# Why an auto adapter has its copies (its status's `desiredReason`): a word, so a steady pool writes no status.
DEMAND = "Demand"  # its share of the pool's demand
MIN_REPLICAS = "MinReplicas"  # demand asks fewer (a cold adapter)
MAX_REPLICAS = "MaxReplicas"  # demand asks more (maxReplicas, or every pod)
SCALE_DOWN_WINDOW = "ScaleDownWindow"  # demand fell, the window's highest recommendation holds
CHURN_CAP = "LoadRateLimited"  # rising, by at most MAX_LOADS_PER_POD_PER_MIN per pod and minute


@dataclass(frozen=True)
class Sizing:
    copies: int
    reason: str


@dataclass(frozen=True)
class DemandMemory:
    counters: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (pod, adapter) -> tokens_served seen
    measured_at: float | None = None  # time of the pass that read `counters`
    rates: Mapping[str, float] = field(default_factory=dict)  # adapter -> smoothed tokens/s
    # adapter -> (time, copies recommended) over the last SCALE_DOWN_WINDOW_S
    recommendations: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    copies: Mapping[str, int] = field(default_factory=dict)  # adapter -> copies decided last pass
    sized_at: float | None = None  # time of the last sizing (the churn cap's clock)


def measure(memory: DemandMemory, counters: Mapping[tuple[str, str], int], now: float) -> DemandMemory:
    """Fold one pass's counters into the smoothed rates. Adapters no pod reports keep decaying towards 0."""
    if memory.measured_at is None:
        return DemandMemory(dict(counters), now, {}, memory.recommendations, memory.copies, memory.sized_at)
    gap = now - memory.measured_at
    if gap < MIN_GAP_S:
        return memory
    served: dict[str, int] = {}
    for (pod, adapter), value in counters.items():
        before = memory.counters.get((pod, adapter))
        if before is None:  # first seen: no interval to count over yet
            served.setdefault(adapter, 0)
            continue
        # A counter below what was seen is an engine that restarted: all of it was served since.
        served[adapter] = served.get(adapter, 0) + (value - before if value >= before else value)
    weight = 1.0 - math.exp(-gap / SMOOTHING_S)
    rates = {}
    for adapter in set(memory.rates) | set(served):
        old = memory.rates.get(adapter, 0.0)
        rate = old + weight * (served.get(adapter, 0) / gap - old)
        if rate > 1e-6 or adapter in served:
            rates[adapter] = rate
    return DemandMemory(dict(counters), now, rates, memory.recommendations, memory.copies, memory.sized_at)


def size(memory: DemandMemory, auto: Mapping[str, Bounds], num_pods: int, total_rate: float | None,
         now: float) -> tuple[dict[str, Sizing], DemandMemory]:
    """Each auto adapter's copies on `num_pods` ready pods. `total_rate`: the pool's demand over every adapter
    (declared ones too; None: the sum of the rates measured)."""
    total = sum(memory.rates.values()) if total_rate is None else total_rate
    budget = max(1, math.floor(MAX_LOADS_PER_POD_PER_MIN * num_pods * _minutes_since(memory, now)))
    wanted: dict[str, tuple[int, str]] = {}
    recommendations: dict[str, tuple[tuple[float, int], ...]] = {}
    for adapter, bounds in auto.items():
        high = num_pods if bounds.max_replicas is None else min(bounds.max_replicas, num_pods)
        low = min(bounds.min_replicas, high)
        rate = memory.rates.get(adapter, 0.0)
        share = rate / total if total > 0 else 0.0
        raw = min(math.ceil(num_pods * share * SPREAD - 1e-9), num_pods) if share > 0 else 0  # never past the pods
        recommended = min(max(raw, low), high)
        # The window's maximum is all that matters: an older entry no higher than the newest never decides again.
        window = tuple((t, n) for t, n in memory.recommendations.get(adapter, ())
                       if now - t < SCALE_DOWN_WINDOW_S and n > recommended) + ((now, recommended),)
        recommendations[adapter] = window
        held = max(n for _, n in window)
        if held > recommended:
            reason = SCALE_DOWN_WINDOW
        elif recommended > raw:
            reason = MIN_REPLICAS
        elif recommended < raw:
            reason = MAX_REPLICAS
        else:
            reason = DEMAND
        wanted[adapter] = (min(max(held, low), high), reason)
    sizings: dict[str, Sizing] = {}
    for adapter in sorted(wanted, key=lambda a: (-memory.rates.get(a, 0.0), a)):  # hottest first
        copies, reason = wanted[adapter]
        before = memory.copies.get(adapter)
        if before is not None and copies > before:
            added = min(copies - before, budget)
            budget -= added
            if before + added < copies:
                copies, reason = before + added, CHURN_CAP
        sizings[adapter] = Sizing(copies, reason)
    return sizings, DemandMemory(memory.counters, memory.measured_at, memory.rates, recommendations,
                                 {a: s.copies for a, s in sizings.items()}, now)


def _minutes_since(memory: DemandMemory, now: float) -> float:
    if memory.sized_at is None:
        return 1.0
    return max(now - memory.sized_at, 0.0) / 60.0
