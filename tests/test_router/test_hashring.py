"""Consistent hashing with bounded loads, in isolation: spread, stability under membership change, the bound."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kubelora.router.hashring import HashRing, bounded_walk, load_bound

PODS = [f"pool-engine-{i}" for i in range(4)]
KEYS = [f"tenant-{i}" for i in range(2000)]


def test_walk_lists_every_replica_once_and_is_deterministic():
    ring = HashRing(PODS)
    for key in KEYS[:50]:
        walk = ring.walk(key)
        assert sorted(walk) == sorted(PODS)
        assert walk == HashRing(list(reversed(PODS))).walk(key)  # order of the input does not matter
    assert HashRing([]).walk("x") == []


def test_keys_spread_evenly():
    homes = Counter(HashRing(PODS).walk(key)[0] for key in KEYS)
    assert set(homes) == set(PODS)
    for pod, n in homes.items():
        assert 0.15 < n / len(KEYS) < 0.35, (pod, n)


def test_adding_a_replica_moves_only_keys_to_it():
    before = HashRing(PODS)
    after = HashRing([*PODS, "pool-engine-new"])
    moved = [key for key in KEYS if before.walk(key)[0] != after.walk(key)[0]]
    assert all(after.walk(key)[0] == "pool-engine-new" for key in moved)
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # about 1/5 of the keys


def test_removing_a_replica_moves_only_its_keys_to_their_next():
    before = HashRing(PODS)
    after = HashRing(PODS[1:])
    for key in KEYS:
        walk = before.walk(key)
        expected = walk[1] if walk[0] == PODS[0] else walk[0]
        assert after.walk(key)[0] == expected


@pytest.mark.parametrize("load_factor", [1.0, 1.25, 2.0])
def test_bound_is_load_factor_times_average(load_factor):
    in_flight = {"a": 3, "b": 1, "c": 0}
    assert load_bound(in_flight, ["a", "b", "c"], load_factor) == math.ceil(load_factor * 5 / 3)


def test_idle_replicas_keep_the_home():
    for key in KEYS[:100]:
        assert bounded_walk(key, PODS, {}, 1.25) == HashRing(PODS).walk(key)


def test_overloaded_home_passes_to_the_next_replica_on_the_ring():
    key = "tenant-hot"
    walk = HashRing(PODS).walk(key)
    in_flight = {walk[0]: 10, walk[1]: 0}
    order = bounded_walk(key, PODS, in_flight, 1.25)
    assert order[0] == walk[1]
    assert sorted(order) == sorted(PODS)  # the rest stays the retry order


@pytest.mark.parametrize("load_factor", [1.0, 1.25, 1.5])
def test_one_hot_key_never_exceeds_the_bound(load_factor):
    """Requests for one key arrive and stay in flight: no replica ends above ceil(c * average)."""
    in_flight: Counter[str] = Counter()
    for n in range(1, 101):
        pod = bounded_walk("tenant-hot", PODS, in_flight, load_factor)[0]
        in_flight[pod] += 1
        assert max(in_flight.values()) <= math.ceil(load_factor * n / len(PODS))


def test_no_candidates_no_walk():
    assert bounded_walk("x", [], {}, 1.25) == []
