"""The placement simulator: our demand placement against least-loaded routing and single-copy affinity, on the
same traces, with no cluster.

    kubelora bench placement [--quick] [--replicas 16] [--adapters 2000] [--hours 6] [--rate 4] [--zipf 1.1]
        [--max-loras 4] [--max-cpu-loras 256] [--load-factor 1] [--seed 0] [--write docs/benchmarks-placement.md]

Traces: bench/placement_traces.py; replicas and their tiers: bench/placement_fleet.py; the policies:
bench/placement_policies.py. Time is simulated: events (arrivals, completions, failures, operator passes, load
windows) are processed in time order, each policy over its own copy of the fleet.

Replica load is a replica's time-averaged requests in flight over a `WINDOW_S` window (windows a replica was up
for throughout). Its spread is each such load over the mean of its window's live replicas, so the day's swing
does not count as imbalance; reported: the mean load and the 99th percentile of that ratio.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from dataclasses import dataclass

from kubelora.bench.placement_fleet import Counts, ReplicaState, TierConfig
from kubelora.bench.placement_policies import (PASS_S, LeastLoaded, Ours, RandomSplit, SingleCopy,
                                               memoized_rendezvous)
from kubelora.bench.placement_traces import Trace, TraceConfig, generate
from kubelora.router.config import RouterConfig

WINDOW_S = 300.0
INF = math.inf


@dataclass(frozen=True)
class PolicyResult:
    name: str
    counts: Counts
    hours: float
    mean_load: float  # requests in flight per replica, time-averaged per window
    p99_over_mean: float  # 99th percentile of (a replica's window load / its window's mean)
    cpu_s: float  # process CPU time of the simulation (the machine may be shared)

    @property
    def loads_per_hour(self) -> float:
        return self.counts.num_loads / self.hours

    @property
    def miss_share(self) -> float:
        return self.counts.num_misses / max(self.counts.num_requests, 1)


class LoadMeter:
    """Time-weighted in-flight count per replica, closed into one sample per window."""

    def __init__(self) -> None:
        self.area: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.up_since: dict[str, float] = {}
        self.windows: list[list[float]] = []

    def start(self, replica: str, now: float) -> None:
        self.area[replica], self.last[replica], self.up_since[replica] = 0.0, now, now

    def stop(self, replica: str) -> None:
        for table in (self.area, self.last, self.up_since):
            del table[replica]

    def change(self, replica: str, num_before: int, now: float) -> None:
        self.area[replica] += num_before * (now - self.last[replica])
        self.last[replica] = now

    def close_window(self, replicas: dict[str, ReplicaState], end: float) -> None:
        loads = []
        for name, state in replicas.items():
            self.change(name, state.num_in_flight, end)
            if self.up_since[name] <= end - WINDOW_S:
                loads.append(self.area[name] / WINDOW_S)
            self.area[name] = 0.0
        if loads:
            self.windows.append(loads)

    def summary(self) -> tuple[float, float]:
        loads = [x for window in self.windows for x in window]
        ratios = sorted(x / (sum(w) / len(w)) for w in self.windows if sum(w) > 0 for x in w)
        if not ratios:
            return 0.0, 0.0
        return sum(loads) / len(loads), ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))]


def simulate(trace: Trace, policy, tiers: TierConfig) -> PolicyResult:
    """Run one policy over the trace from an empty fleet."""
    started = time.process_time()
    counts, meter = Counts(), LoadMeter()
    replicas = {name: ReplicaState(tiers) for name in trace.replicas}
    for name in replicas:
        meter.start(name, 0.0)
    in_flight = dict.fromkeys(replicas, 0)
    epochs = dict.fromkeys(replicas, 0)
    outages = sorted([(f.down_at_s, 0, f.replica) for f in trace.failures] +
                     [(f.up_at_s, 1, f.replica) for f in trace.failures])
    done: list[tuple[float, int, str, int, str, int]] = []  # (end, seq, replica, epoch, adapter, tokens)
    next_pass = 0.0 if isinstance(policy, Ours) else INF
    next_window, next_outage, seen = WINDOW_S, 0, set()
    live = sorted(replicas)
    for seq, request in enumerate(trace.requests):
        while True:
            t = min(done[0][0] if done else INF, outages[next_outage][0] if next_outage < len(outages) else INF,
                    next_pass, next_window)
            if t > request.at_s:
                break
            if done and done[0][0] == t:
                _, _, name, epoch, adapter, tokens = heapq.heappop(done)
                if epochs[name] == epoch:
                    meter.change(name, in_flight[name], t)
                    replicas[name].finish(adapter, tokens)
                    in_flight[name] -= 1
            elif next_outage < len(outages) and outages[next_outage][0] == t:
                _, is_up, name = outages[next_outage]
                next_outage += 1
                _outage(name, bool(is_up), t, replicas, in_flight, epochs, meter, tiers)
                live = sorted(replicas)
            elif next_pass == t:
                policy.on_pass(t, replicas, counts)
                next_pass += PASS_S
            else:
                meter.close_window(replicas, t)
                next_window += WINDOW_S
        name = policy.choose(request.adapter, live, in_flight, seq)
        meter.change(name, in_flight[name], request.at_s)
        replicas[name].serve(request.adapter, counts, request.adapter not in seen)
        seen.add(request.adapter)
        in_flight[name] += 1
        heapq.heappush(done, (request.at_s + request.duration_s, seq, name, epochs[name], request.adapter,
                              request.num_tokens))
    mean_load, p99 = meter.summary()
    return PolicyResult(policy.name, counts, trace.config.day_s / 3600, mean_load, p99,
                        time.process_time() - started)


def _outage(name: str, is_up: bool, now: float, replicas: dict[str, ReplicaState], in_flight: dict[str, int],
            epochs: dict[str, int], meter: LoadMeter, tiers: TierConfig) -> None:
    """A replica goes down (its requests in flight are lost with it) or comes back empty."""
    if is_up and name not in replicas:
        replicas[name], in_flight[name] = ReplicaState(tiers), 0
        meter.start(name, now)
    elif not is_up and name in replicas:
        del replicas[name], in_flight[name]
        epochs[name] += 1
        meter.stop(name)


def run_all(trace: Trace, tiers: TierConfig, load_factor: float) -> list[PolicyResult]:
    with memoized_rendezvous():
        results = [simulate(trace, Ours(trace.adapters, tiers.max_cpu_loras, load_factor), tiers)]
    others = (LeastLoaded(), SingleCopy(), RandomSplit(trace.config.seed))
    return results + [simulate(trace, policy, tiers) for policy in others]


QUICK = dict(num_replicas=4, num_adapters=50, day_s=1800.0, mean_rate=2.0, num_failures=1, down_s=300.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kubelora bench placement", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny fleet and half an hour (seconds; for tests)")
    p.add_argument("--replicas", type=int, default=TraceConfig.num_replicas)
    p.add_argument("--adapters", type=int, default=TraceConfig.num_adapters)
    p.add_argument("--hours", type=float, default=TraceConfig.day_s / 3600, help="the simulated day")
    p.add_argument("--rate", type=float, default=TraceConfig.mean_rate, help="mean requests per second")
    p.add_argument("--zipf", type=float, default=TraceConfig.zipf_s)
    p.add_argument("--max-loras", type=int, default=TierConfig.max_loras)
    p.add_argument("--max-cpu-loras", type=int, default=TierConfig.max_cpu_loras)
    p.add_argument("--load-factor", type=float, default=RouterConfig.load_factor,
                   help="the router's load bound (router/config.py; its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", default=None, help="write the markdown report to this path")
    return p.parse_args(argv)


def trace_config(args: argparse.Namespace) -> TraceConfig:
    if args.quick:
        return TraceConfig(seed=args.seed, zipf_s=args.zipf, **QUICK)
    return TraceConfig(num_replicas=args.replicas, num_adapters=args.adapters, day_s=args.hours * 3600,
                       mean_rate=args.rate, zipf_s=args.zipf, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    from kubelora.bench.placement_report import METHOD, render_markdown, render_table

    args = parse_args(argv)
    config = trace_config(args)
    tiers = TierConfig(args.max_loras, args.max_cpu_loras)
    trace = generate(config)
    results = run_all(trace, tiers, args.load_factor)
    print(render_table(results))
    if args.write:
        with open(args.write, "w") as f:
            f.write(render_markdown(trace, tiers, args.load_factor, results, METHOD,
                                    " ".join(["kubelora bench placement", *(sys.argv[1:] if argv is None else argv)])))
        print(f"wrote {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
