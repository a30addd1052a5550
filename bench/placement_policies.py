"""The three policies the placement simulator compares, each choosing a replica per request.

- `Ours`: the operator's and router's own decision code. Every pass (`pass_s`, the operator's resync) the
  replicas' `tokens_served` counters go through `demand.measure` and `demand.size` (every adapter is
  `replicas: auto` with the default bounds), the copies through `placement.place` (capacity: the host tier;
  previous placement: last pass's, for its hysteresis), and each replica preloads what it was placed and does
  not hold, as the operator's plan asks (`preload: true` for a placed adapter not resident). Each request goes
  where `router.routing.route` sends it over the published placement, with the simulation's in-flight counts;
  a candidate that is down (failed since the pass) is skipped, as the router's retry does.
- `LeastLoaded`: every request to the replica with the fewest in flight (the router's `least_loaded`), adapters
  loaded on demand.
- `SingleCopy`: each adapter on one replica, its hashed home over the live replicas (the router's ring, no load
  bound); requests always go there.
- `RandomSplit` (a reference, not a contender): every request to a uniformly random live replica; its replica
  load spread is what chance alone gives at the trace's concurrency, with no look at load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

from kubelora.bench.placement_fleet import Counts, ReplicaState
from kubelora.operator import demand, placement
from kubelora.router import routing
from kubelora.router.hashring import ring_for
from kubelora.router.placement import Placement as RouterPlacement, Replica

PASS_S = 30.0  # the operator's default resync (operator/settings.py resync_s)


class LeastLoaded:
    name = "least-loaded"

    def choose(self, adapter: str, live: Sequence[str], in_flight: Mapping[str, int], tiebreak: int) -> str:
        return routing.least_loaded(list(live), in_flight, tiebreak)[0]


class SingleCopy:
    name = "single-copy"

    def __init__(self) -> None:
        self._homes: dict[str, str] = {}
        self._live: frozenset[str] = frozenset()

    def choose(self, adapter: str, live: Sequence[str], in_flight: Mapping[str, int], tiebreak: int) -> str:
        if frozenset(live) != self._live:
            self._live, self._homes = frozenset(live), {}
        home = self._homes.get(adapter)
        if home is None:
            home = self._homes[adapter] = ring_for(self._live).walk(adapter)[0]
        return home


class RandomSplit:
    name = "random (reference)"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, adapter: str, live: Sequence[str], in_flight: Mapping[str, int], tiebreak: int) -> str:
        return live[self._rng.randrange(len(live))]


class Ours:
    name = "ours"

    def __init__(self, adapters: Sequence[str], capacity: int, load_factor: float) -> None:
        self._auto = {a: demand.Bounds() for a in adapters}
        self._capacity = capacity
        self._load_factor = load_factor
        self._memory = demand.DemandMemory()
        self._placement: placement.Placement | None = None
        self._placed_from: tuple | None = None  # the inputs that gave self._placement, and whether it is stable
        self._routed: RouterPlacement | None = None
        self._placed_on: dict[str, list[str]] = {}  # pod -> adapters placed there
        self.num_place_calls = 0

    def choose(self, adapter: str, live: Sequence[str], in_flight: Mapping[str, int], tiebreak: int) -> str:
        candidates = routing.route(self._routed, adapter, in_flight, self._load_factor, tiebreak).candidates
        return next(c.pod for c in candidates if c.pod in in_flight)  # in_flight lists the live replicas

    def on_pass(self, now: float, replicas: Mapping[str, ReplicaState], counts: Counts) -> None:
        pods = sorted(replicas)
        self._memory = demand.measure(self._seeded(replicas), _counters(replicas), now)
        sizings, self._memory = demand.size(self._memory, self._auto, len(pods), None, now)
        requests = tuple(placement.PlacementRequest(a, s.copies) for a, s in sorted(sizings.items()))
        self._place(requests, pods)
        for pod in pods:
            for adapter in self._placed_on.get(pod, ()):
                replicas[pod].preload(adapter, counts)

    def _seeded(self, replicas: Mapping[str, ReplicaState]) -> demand.DemandMemory:
        """The memory as the engines' previous answers made it: an engine lists every registered adapter, those
        it has not served at 0; the simulation reports only served ones, so a pair new on a pod that answered
        last pass is added at 0 (a pod that did not answer last pass has no previous values, as in the pool)."""
        before = self._memory.counters
        answered = {pod for pod, _ in before}
        new = {(pod, a): 0 for pod, state in replicas.items() if pod in answered
               for a in state.tokens_served if (pod, a) not in before}
        return dataclasses.replace(self._memory, counters={**before, **new}) if new else self._memory

    def _place(self, requests: tuple[placement.PlacementRequest, ...], pods: list[str]) -> None:
        """`place` is pure: the same requests and pods with the previous placement equal to its own output give
        that output again, so a steady pass reuses it (a 2,000-adapter placement takes ~0.2 s of Python)."""
        key = (requests, tuple(pods))
        if self._placed_from == (key, True):
            return
        previous = self._placement.pods_by_adapter if self._placement is not None else None
        self._placement = placement.place(requests, pods, self._capacity, previous)
        self.num_place_calls += 1
        self._placed_from = (key, previous == self._placement.pods_by_adapter)
        self._placed_on = {}
        for adapter, holders in self._placement.pods_by_adapter.items():
            for pod in holders:
                self._placed_on.setdefault(pod, []).append(adapter)
        self._routed = RouterPlacement("pool", "base", self.num_place_calls,
                                       tuple(Replica(pod, f"http://{pod}:8000", True) for pod in pods),
                                       MappingProxyType(dict(self._placement.pods_by_adapter)))


@contextlib.contextmanager
def memoized_rendezvous() -> Iterator[None]:
    """The operator's rendezvous score memoized while simulating: a pure hash of (adapter, pod), recomputed
    ~100,000 times by a 2,000-adapter placement, the same values every pass; the decisions do not change."""
    original = placement.rendezvous_score
    placement.rendezvous_score = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        placement.rendezvous_score = original


def _counters(replicas: Mapping[str, ReplicaState]) -> dict[tuple[str, str], int]:
    return {(pod, a): n for pod, state in replicas.items() for a, n in state.tokens_served.items()}
