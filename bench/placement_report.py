"""The placement simulator's table, its targets and its markdown page (docs/benchmarks-placement.md)."""

from __future__ import annotations

import datetime
import os
import platform
import sys

from kubelora.bench.placement_fleet import TierConfig
from kubelora.bench.placement_policies import PASS_S
from kubelora.bench.placement_sim import WINDOW_S, PolicyResult
from kubelora.bench.placement_traces import Trace
from kubelora.operator import demand

MIN_LOAD_REDUCTION = 0.30  # fewer adapter loads than least-loaded routing
MAX_P99_OVER_MEAN = 1.25
MAX_MISS_SHARE = 0.01

METHOD = """
Each policy serves the same trace (bench/placement_traces.py) from an empty fleet; the events (arrivals,
completions, failures, operator passes, load windows) run in simulated time, so the run's wall time says
nothing about the policies.

- **ours**: every operator pass (30 s, the operator's resync) the replicas' per-adapter `tokens_served`
  counters (prompt + generated tokens of the requests each replica finished since it started) go through
  `operator/demand.py` (`measure`, then `size` with every adapter `replicas: auto` at the default bounds); the
  copies through `operator/placement.py` (`place`, capacity the host tier, last pass's placement as previous);
  each replica preloads what it was placed and does not hold, as the operator's plan asks (a placed adapter not
  resident is loaded with `preload: true`, every pass). Each request goes where `router/routing.py` (`route`)
  sends it over that placement with the replicas' requests in flight; a candidate that failed since the pass
  is skipped, as the router's retry skips it.
- **least-loaded**: every request to the replica with the fewest requests in flight (the router's
  `least_loaded`); adapters load on demand.
- **single-copy**: each adapter on one replica, its hashed home on the router's ring over the live replicas,
  no load bound; adapters load on demand.
- **random (reference)**: every request to a uniformly random replica. Not a contender: its load spread is
  what chance gives at this concurrency without looking at load, the scale for the p99 column.

Per replica, a host tier of `max_cpu_loras` adapters and within it a device tier of `max_loras`, each least
recently used; an adapter with requests in flight on a replica is not evicted from its host tier (the engine's
rule). A **miss** is a request whose adapter is in neither tier of the replica it reached, each adapter's first
request in the run excluded; it loads the adapter into the host tier. **Loads** count every load into a host
tier: misses, first requests and ours' preloads (shown apart). **Device swaps** (host to device tier) are
counted apart and are not a target. A failed replica's requests in flight are dropped; it comes back empty.

**Replica load** is a replica's requests in flight, averaged over time in 5-minute windows (windows it was up
for throughout). The mean is over every such sample; **p99 / mean** is the 99th percentile of each sample
over the mean of its window's replicas, so the day's swing is not counted as imbalance.

**Tiers.** The device tier is the LoRAPool's default `maxLoras` (4). The host tier is sized so one copy of
every adapter fits the fleet (16 x 256 slots for 2,000 adapters): every `replicas: auto` adapter has at least
one copy (`minReplicas` >= 1), so at the engine's default 16 or the LoRAPool's default 8 the placement falls
short (by adapter name), the adapters left out load on demand at their hashed homes, evict placed ones, and
the operator preloads those again every pass (run with `--max-cpu-loras 16` to see that regime).
"""

# What decides our policy's spread, as the code stands: read with the table's p99 column.
SPREAD_NOTE = """
**What decides ours' spread.** An adapter's requests go only to its holders: the router's bound (`load factor
x` the holders' mean in flight) always admits one of them, so it evens holders against each other, not against
the fleet. So `size` gives copies at `SPREAD` (8) times an adapter's share of pods: an adapter with 1/8 of the
demand is on every replica, one with 1/128 on two of 16, and the router's strict bound (load factor 1) moves
each hot adapter's requests to the holders with fewest in flight, which evens out the replicas that also hold
adapters pinned to one copy. The extra copies are the preloads above single-copy's loads. Least-loaded routing
looks at load on every request and pays for it in loads and misses; the random split shows what no look at load
gives.
"""

COLUMNS = ("policy", "requests", "loads / h", "of which preloads / h", "misses", "device swaps / h",
           "mean load (in flight)", "p99 / mean load", "sim CPU s")


def rows(results: list[PolicyResult]) -> list[tuple[str, ...]]:
    return [(r.name, str(r.counts.num_requests), f"{r.loads_per_hour:.0f}", f"{r.counts.num_preloads / r.hours:.0f}",
             f"{100 * r.miss_share:.2f}%", f"{r.counts.num_swaps / r.hours:.0f}", f"{r.mean_load:.2f}",
             f"{r.p99_over_mean:.2f}", f"{r.cpu_s:.1f}") for r in results]


def render_table(results: list[PolicyResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    return "\n".join(lines)


def verdicts(results: list[PolicyResult]) -> list[tuple[str, str, str]]:
    """(target, met or MISSED, figures) for our policy."""
    by_name = {r.name: r for r in results}
    ours, baseline = by_name["ours"], by_name["least-loaded"]
    reduction = 1.0 - ours.counts.num_loads / max(baseline.counts.num_loads, 1)
    checks = [
        (f">= {MIN_LOAD_REDUCTION:.0%} fewer adapter loads than least-loaded", reduction >= MIN_LOAD_REDUCTION,
         f"{reduction:.0%} fewer ({ours.loads_per_hour:.0f} / h against {baseline.loads_per_hour:.0f} / h)"),
        (f"p99 replica load <= {MAX_P99_OVER_MEAN}x the mean", ours.p99_over_mean <= MAX_P99_OVER_MEAN,
         f"{ours.p99_over_mean:.2f}x"),
        (f"misses < {MAX_MISS_SHARE:.0%} of requests", ours.miss_share < MAX_MISS_SHARE,
         f"{100 * ours.miss_share:.2f}% ({ours.counts.num_misses} of {ours.counts.num_requests})"),
    ]
    return [(name, "met" if ok else "MISSED", figures) for name, ok, figures in checks]


def render_verdicts(results: list[PolicyResult]) -> str:
    lines = ["| target (ours) | verdict | figures |", "|---|---|---|"]
    lines += [f"| {name} | {verdict} | {figures} |" for name, verdict, figures in verdicts(results)]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def _environment() -> list[str]:
    return [f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({_cpu_model()}), "
            "shared with other work (the table's CPU seconds are the simulation's own)",
            f"- python: {sys.version.split()[0]} on {platform.system()} {platform.release()}",
            f"- date: {datetime.date.today().isoformat()}"]


def _shape(trace: Trace, tiers: TierConfig, load_factor: float) -> list[str]:
    c = trace.config
    return [f"- fleet: {c.num_replicas} replicas, {c.num_adapters} adapters (all `replicas: auto`, default bounds)",
            f"- tiers per replica: device `max_loras` {tiers.max_loras}, host `max_cpu_loras` {tiers.max_cpu_loras}",
            f"- day: {c.day_s / 3600:g} h simulated (one diurnal cycle; a day compressed, so demand moves faster "
            f"than in a real one while the operator's windows keep their seconds), {len(trace.requests)} requests, mean {c.mean_rate:g} / s "
            f"(x{1 - c.diurnal_swing:g} at midnight to x{1 + c.diurnal_swing:g} at noon), lognormal durations of "
            f"mean {c.mean_duration_s:g} s",
            f"- popularity: Zipf s = {c.zipf_s:g}; {c.num_drift_swaps} top-100 rank swaps an hour; one cold tenant "
            f"at {c.hot_share:.0%} of requests from {c.hot_start:.0%} to {c.hot_end:.0%} of the day",
            f"- failures: {c.num_failures} replicas down {c.down_s / 60:g} min each, back empty",
            f"- operator pass every {PASS_S:g} s; demand: SMOOTHING_S {demand.SMOOTHING_S:g}, SCALE_DOWN_WINDOW_S "
            f"{demand.SCALE_DOWN_WINDOW_S:g}, MAX_LOADS_PER_POD_PER_MIN {demand.MAX_LOADS_PER_POD_PER_MIN}; "
            f"router load factor {load_factor:g}",
            f"- seed: {c.seed}; load windows of {WINDOW_S:g} s"]


def render_markdown(trace: Trace, tiers: TierConfig, load_factor: float, results: list[PolicyResult],
                    method: str, command: str) -> str:
    parts = ["# Placement simulator: demand placement against least-loaded routing and single-copy affinity", "",
             f"Written by `{command}` (`bench/placement_sim.py`).", "", *_environment(), "", "## Shape", "",
             *_shape(trace, tiers, load_factor), "", "## Method", "", method.strip(), "", "## Results", "",
             render_table(results), "", render_verdicts(results), "", SPREAD_NOTE.strip(), ""]
    return "\n".join(parts)
