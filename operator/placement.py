"""Which engine pods preload which adapters: rendezvous hashing with capacity bounds and hysteresis.

Pure: the reconcile hands in the ready pods, each adapter's wanted replica count and the placement it
published last time; it gets back the new placement. Properties the tests pin down:
- an adapter's current holders stay while they are ready and within capacity; they are held to the balance
  bound (`BALANCE_FACTOR` x the mean copies per pod) only when keeping them all would leave some pod
  underloaded (below the mean / `BALANCE_FACTOR`): so another adapter coming or going, even a bulk delete that
  lowers the mean, moves nothing, and a scale-out moves only the copies that overloaded pods shed (those pods
  keep the adapters that rank them highest), so new pods take traffic instead of idling (a DESIGN.md failure
  mode);
- new copies go to the pods with the highest rendezvous score for the adapter (stable, spread evenly),
  pods under the balance bound first;
- no pod holds more than `capacity` placed adapters (the engine's host tier, engine.maxCpuLoras), nor more
  adapter bytes than its device adapter pool's budget (each adapter at its own rank, as the engine counts
  them; both reported by the engine's `GET /v1/models`), except `replicas: all` adapters, which are on every
  pod by definition (they count towards the room of the others);
- when room runs out an adapter gets fewer copies than asked (reported as a shortage), never more.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


BALANCE_FACTOR = 1.25  # a pod keeps its adapters up to this multiple of the mean copies per pod


@dataclass(frozen=True)
class PlacementRequest:
    adapter: str
    replicas: int | None  # None: every pod


@dataclass
class Room:
    """What each pod has left while placing: adapter slots and, where the pod reported a budget, bytes."""
    slots: dict[str, int]  # pod -> placed adapters so far
    capacity: int
    used_bytes: dict[str, int]
    budgets: Mapping[str, int]  # pod -> device adapter pool bytes; a pod missing here has no byte bound
    sizes: Mapping[str, int]  # adapter -> bytes at its own rank; unknown (never registered yet): 0

    def fits(self, adapter: str, pod: str, slot_bound: int) -> bool:
        if self.slots[pod] >= slot_bound:
            return False
        budget = self.budgets.get(pod)
        return budget is None or self.used_bytes[pod] + self.sizes.get(adapter, 0) <= budget

    def take(self, adapter: str, pod: str) -> None:
        self.slots[pod] += 1
        self.used_bytes[pod] += self.sizes.get(adapter, 0)


@dataclass(frozen=True)
class Placement:
    pods_by_adapter: dict[str, tuple[str, ...]]
    wanted_by_adapter: dict[str, int]  # copies asked for, bounded by the number of pods

    def pods_of(self, adapter: str) -> tuple[str, ...]:
        return self.pods_by_adapter.get(adapter, ())

    def adapters_on(self, pod: str) -> list[str]:
        return sorted(a for a, pods in self.pods_by_adapter.items() if pod in pods)

    def shortage(self, adapter: str) -> int:
        return self.wanted_by_adapter.get(adapter, 0) - len(self.pods_of(adapter))


def rendezvous_score(adapter: str, pod: str) -> int:
    digest = hashlib.sha256(f"{adapter}\x00{pod}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def rank_pods(adapter: str, pods: Iterable[str]) -> list[str]:
    """Pods in the adapter's preference order (highest score first; ties cannot matter: names differ)."""
    return sorted(pods, key=lambda pod: (-rendezvous_score(adapter, pod), pod))


# Every pass ranks the same pods for every adapter (a digest per adapter and pod, then a sort): the rankings of this
# many adapters over one pod set are kept (about 300 bytes each at 16 pods), which makes a pass's placement several
# times cheaper.
RANKINGS_KEPT = 1 << 14


@functools.lru_cache(maxsize=RANKINGS_KEPT)
def _ranking(adapter: str, pods: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(rank_pods(adapter, pods))


def _ranked_among(adapter: str, pods: tuple[str, ...], among: Iterable[str]) -> list[str]:
    """`among` (some of `pods`) in the adapter's preference order."""
    among = set(among)
    return [pod for pod in _ranking(adapter, pods) if pod in among]


def place(requests: Iterable[PlacementRequest], pods: Iterable[str], capacity: int,
          previous: Mapping[str, Iterable[str]] | None = None, *, sizes: Mapping[str, int] | None = None,
          budgets: Mapping[str, int] | None = None) -> Placement:
    """Place every request on the given (ready) pods; `previous` maps adapter -> pods holding it now.

    sizes: adapter -> device pool bytes at its own rank; budgets: pod -> its device adapter pool bytes."""
    pods = tuple(sorted(set(pods)))
    requests = sorted(requests, key=lambda r: r.adapter)
    previous = previous or {}
    room = Room(dict.fromkeys(pods, 0), capacity, dict.fromkeys(pods, 0), budgets or {}, sizes or {})
    chosen: dict[str, list[str]] = {}
    wanted = {r.adapter: len(pods) if r.replicas is None else min(r.replicas, len(pods)) for r in requests}
    for request in requests:
        if request.replicas is None:
            chosen[request.adapter] = list(pods)
            for pod in pods:
                room.take(request.adapter, pod)
    partial = [r for r in requests if r.replicas is not None]
    balance = _balance_bound(sum(wanted.values()), len(pods), capacity)
    holders = _holder_pairs(partial, pods, previous)
    if not _leaves_a_pod_underloaded(holders, wanted, room, capacity, len(pods)):
        balance_for_holders = capacity
    else:
        balance_for_holders = balance
    for request in partial:
        chosen[request.adapter] = []
    for _, adapter, pod in holders:  # hysteresis, best-ranked holders first
        if len(chosen[adapter]) < wanted[adapter] and room.fits(adapter, pod, balance_for_holders):
            chosen[adapter].append(pod)
            room.take(adapter, pod)
    for request in partial:
        ranked = _ranking(request.adapter, pods)
        for bound in (balance, capacity):  # pods under the balance bound first, then any with room
            chosen[request.adapter] = _take(request.adapter, ranked, wanted[request.adapter], room, bound,
                                            chosen[request.adapter])
    ordered = {a: tuple(_ranked_among(a, pods, p)) for a, p in chosen.items()}
    return Placement(pods_by_adapter=ordered, wanted_by_adapter=wanted)


def _leaves_a_pod_underloaded(holders: list[tuple[int, str, str]], wanted: Mapping[str, int], room: Room,
                              capacity: int, num_pods: int) -> bool:
    """Would keeping every holder (within its room) leave a pod below the mean / BALANCE_FACTOR copies?"""
    if num_pods == 0:
        return False
    trial = Room(dict(room.slots), room.capacity, dict(room.used_bytes), room.budgets, room.sizes)
    kept: dict[str, int] = {}
    for _, adapter, pod in holders:
        if kept.get(adapter, 0) < wanted[adapter] and trial.fits(adapter, pod, capacity):
            kept[adapter] = kept.get(adapter, 0) + 1
            trial.take(adapter, pod)
    floor = sum(wanted.values()) / num_pods / BALANCE_FACTOR
    return min(trial.slots.values()) < math.floor(floor)


def _balance_bound(num_copies: int, num_pods: int, capacity: int) -> int:
    if num_pods == 0:
        return 0
    return min(capacity, max(1, math.ceil(BALANCE_FACTOR * num_copies / num_pods)))


def _holder_pairs(requests: list[PlacementRequest], pods: tuple[str, ...],
                  previous: Mapping[str, Iterable[str]]) -> list[tuple[int, str, str]]:
    """(rank of the pod for the adapter, adapter, pod) for current holders, best-ranked first: an overloaded
    pod keeps the adapters that prefer it most."""
    pairs = []
    for request in requests:
        holders = previous.get(request.adapter, ())
        for index, pod in enumerate(_ranked_among(request.adapter, pods, holders)):
            pairs.append((index, request.adapter, pod))
    return sorted(pairs, key=lambda pair: (pair[0], -rendezvous_score(pair[1], pair[2]), pair[1]))


def _take(adapter: str, candidates: list[str], wanted: int, room: Room, bound: int, taken: list[str]) -> list[str]:
    taken = list(taken)
    for pod in candidates:
        if len(taken) >= wanted:
            break
        if pod in taken or not room.fits(adapter, pod, bound):
            continue
        taken.append(pod)
        room.take(adapter, pod)
    return taken
