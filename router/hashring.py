"""Bounded-load consistent hashing: which replica serves a key, given every candidate's in-flight count.

A ring of `VNODES` points per replica (blake2b of "replica#i"); a key starts at the first point at or after its
own hash and walks clockwise. With bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016) a replica is taken only
while its in-flight count is below `ceil(load_factor * (total + 1) / n)`, so no replica carries more than
load_factor times the average; an overloaded one passes the key to the next replica on the ring. Adding or
removing one replica moves only the keys whose walk passed it, so adapters stay where their weights are.

Pure functions and one small immutable class: no I/O, no clocks, tested on their own.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

# 64 points per replica keep the share of keys per replica within a few percent for the 2..64 replicas of a pool.
VNODES = 64


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """An immutable ring over distinct replica names."""

    def __init__(self, replicas: Sequence[str], vnodes: int = VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        points = sorted((hash64(f"{name}#{i}"), name) for name in set(replicas) for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._names = [name for _, name in points]
        self.replicas = frozenset(replicas)

    def walk(self, key: str) -> list[str]:
        """Every replica once, in ring order from the key's position: [home, next, ...]."""
        if not self._names:
            return []
        start = bisect.bisect_left(self._hashes, hash64(key))
        order: list[str] = []
        seen: set[str] = set()
        for i in range(len(self._names)):
            name = self._names[(start + i) % len(self._names)]
            if name not in seen:
                seen.add(name)
                order.append(name)
                if len(order) == len(self.replicas):
                    break
        return order


@lru_cache(maxsize=1024)
def ring_for(replicas: frozenset[str]) -> HashRing:
    """Rings are cached per replica set: a pool has few distinct holder sets, and requests are many."""
    return HashRing(sorted(replicas))


def load_bound(in_flight: Mapping[str, int], candidates: Sequence[str], load_factor: float) -> int:
    """Most in-flight requests one candidate may already have and still take a new one (exclusive bound)."""
    total = sum(in_flight.get(name, 0) for name in candidates)
    return math.ceil(load_factor * (total + 1) / len(candidates))


def bounded_walk(key: str, candidates: Sequence[str], in_flight: Mapping[str, int], load_factor: float) -> list[str]:
    """Candidates in the order to try them: the first replica on the key's walk that is under the bound, then the
    rest of the walk (the retry order). Empty when there are no candidates."""
    return tiered_walk(key, [candidates], in_flight, load_factor)


def tiered_walk(key: str, tiers: Sequence[Sequence[str]], in_flight: Mapping[str, int],
                load_factor: float) -> list[str]:
    """Every tier's candidates on the key's walk over that tier, tier after tier; the first of them under the load
    bound over all tiers leads and the others follow in that order (the retry order). So a preferred tier keeps
    the key until its replica has more than its share of all candidates' load."""
    order = [name for tier in tiers if tier for name in ring_for(frozenset(tier)).walk(key)]
    if not order:
        return []
    bound = load_bound(in_flight, order, load_factor)
    # The bound is at least the average plus one, so some candidate is always under it.
    chosen = next(i for i, name in enumerate(order) if in_flight.get(name, 0) < bound)
    return order[chosen:] + order[:chosen]
