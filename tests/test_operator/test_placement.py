import math
from collections import Counter

from kubelora.operator.placement import BALANCE_FACTOR, PlacementRequest, place, rank_pods

PODS = [f"pod-{i}" for i in range(4)]


def requests(n, replicas=1):
    return [PlacementRequest(f"a{i}", replicas) for i in range(n)]


def test_k_copies_on_the_best_ranked_pods_deterministically():
    placement = place(requests(1, replicas=2), PODS, capacity=10)
    assert placement.pods_of("a0") == tuple(rank_pods("a0", PODS)[:2])
    many = place(requests(30, replicas=2), PODS, capacity=100)
    assert all(len(set(many.pods_of(f"a{i}"))) == 2 for i in range(30))
    assert place(requests(30, replicas=2), reversed(PODS), capacity=100) == many


def test_all_means_every_pod_and_more_copies_than_pods_are_bounded():
    placement = place([PlacementRequest("x", None), PlacementRequest("y", 9)], PODS, capacity=10)
    assert set(placement.pods_of("x")) == set(PODS) and set(placement.pods_of("y")) == set(PODS)
    assert placement.wanted_by_adapter == {"x": 4, "y": 4}


def test_capacity_bounds_every_pod_and_reports_the_shortage():
    placement = place(requests(10), PODS, capacity=2)
    load = Counter(p for pods in placement.pods_by_adapter.values() for p in pods)
    assert max(load.values()) <= 2 and sum(load.values()) == 8
    assert sum(placement.shortage(f"a{i}") for i in range(10)) == 2


def test_all_adapters_count_towards_capacity():
    placement = place([PlacementRequest("all", None)] + requests(4), PODS[:2], capacity=2)
    load = Counter(p for pods in placement.pods_by_adapter.values() for p in pods)
    assert load == {"pod-0": 2, "pod-1": 2}


def test_spread_is_even_enough():
    placement = place(requests(200), PODS, capacity=1000)
    load = Counter(p for pods in placement.pods_by_adapter.values() for p in pods)
    assert min(load.values()) > 30


def test_a_new_adapter_moves_nothing_else():
    before = place(requests(20), PODS, capacity=100)
    after = place(requests(21), PODS, capacity=100, previous=before.pods_by_adapter)
    assert all(after.pods_of(a) == pods for a, pods in before.pods_by_adapter.items())


def test_scale_out_moves_only_what_overloaded_pods_shed():
    before = place(requests(40), PODS[:2], capacity=100)
    after = place(requests(40), PODS, capacity=100, previous=before.pods_by_adapter)
    load = Counter(p for pods in after.pods_by_adapter.values() for p in pods)
    bound = math.ceil(BALANCE_FACTOR * 40 / 4)
    assert max(load.values()) <= bound and load["pod-2"] + load["pod-3"] > 0  # new pods take work
    moved = [a for a, pods in before.pods_by_adapter.items() if after.pods_of(a) != pods]
    assert all(set(after.pods_of(a)) <= {"pod-2", "pod-3"} for a in moved)  # only onto the new pods
    assert len(moved) == 40 - load["pod-0"] - load["pod-1"]
    again = place(requests(40), PODS, capacity=100, previous=after.pods_by_adapter)
    assert again == after  # stable once balanced


def test_lost_pod_moves_only_its_adapters():
    before = place(requests(20, replicas=2), PODS, capacity=100)
    after = place(requests(20, replicas=2), PODS[:3], capacity=100, previous=before.pods_by_adapter)
    for adapter, pods in before.pods_by_adapter.items():
        kept = set(pods) - {"pod-3"}
        assert kept <= set(after.pods_of(adapter)) and len(after.pods_of(adapter)) == 2


def test_fewer_replicas_keep_the_best_ranked_holders():
    before = place(requests(5, replicas=3), PODS, capacity=100)
    after = place(requests(5, replicas=1), PODS, capacity=100, previous=before.pods_by_adapter)
    for i in range(5):
        assert after.pods_of(f"a{i}") == (rank_pods(f"a{i}", before.pods_of(f"a{i}"))[0],)


def test_holders_over_capacity_are_trimmed_and_no_pods_places_nothing():
    previous = {f"a{i}": ("pod-0",) for i in range(5)}
    placement = place(requests(5), ["pod-0"], capacity=3, previous=previous)
    assert sum(1 for i in range(5) if placement.pods_of(f"a{i}")) == 3
    assert place(requests(2), [], capacity=3).pods_by_adapter == {"a0": (), "a1": ()}


# ---- room in bytes: each adapter at its own rank against each pod's device adapter pool budget ----

def test_bytes_bound_each_pod_not_a_count():
    # Budget 100 bytes per pod, plenty of slots: four 40-byte adapters fit two per pod, the fifth nowhere.
    sizes = {f"a{i}": 40 for i in range(5)}
    placement = place(requests(5), PODS[:2], capacity=10, sizes=sizes, budgets={p: 100 for p in PODS[:2]})
    load = Counter(p for pods in placement.pods_by_adapter.values() for p in pods)
    assert load == {"pod-0": 2, "pod-1": 2} and sum(placement.shortage(f"a{i}") for i in range(5)) == 1
    # Small adapters fill the same budget many times over: rank, not count, is what takes room.
    small = {f"a{i}": 10 for i in range(16)}
    many = place(requests(16), PODS[:2], capacity=10, sizes=small, budgets={p: 100 for p in PODS[:2]})
    assert all(many.shortage(f"a{i}") == 0 for i in range(16))


def test_a_pod_without_a_reported_budget_is_bound_by_slots_only():
    placement = place(requests(4), ["pod-0"], capacity=4, sizes={f"a{i}": 1000 for i in range(4)}, budgets={})
    assert all(placement.shortage(f"a{i}") == 0 for i in range(4))


def test_all_adapters_take_bytes_everywhere_and_holders_keep_only_what_fits():
    sizes = {"big": 80, "x": 30, "y": 10}
    budgets = {p: 100 for p in PODS[:2]}
    placement = place([PlacementRequest("big", None), PlacementRequest("x", 1), PlacementRequest("y", 1)],
                      PODS[:2], capacity=10, sizes=sizes, budgets=budgets, previous={"x": ["pod-0"]})
    assert placement.pods_of("big") == tuple(rank_pods("big", PODS[:2]))
    assert placement.pods_of("x") == () and placement.shortage("x") == 1  # 80 + 30 > 100 on both pods
    assert len(placement.pods_of("y")) == 1


def test_a_bulk_delete_moves_no_survivor_unless_a_pod_would_idle():
    # 4 pods x 200 adapters; deletes take 25 from pod-1 and 21 from pod-2. The mean drops, pod-0 is now above
    # BALANCE_FACTOR x the mean, but no pod is below mean / BALANCE_FACTOR: nothing moves.
    before = place(requests(200), PODS, capacity=1000)
    on = {pod: [a for a, pods in before.pods_by_adapter.items() if pods == (pod,)] for pod in PODS}
    gone = set(on["pod-1"][:25] + on["pod-2"][:21])
    survivors = [r for r in requests(200) if r.adapter not in gone]
    load = Counter(before.pods_of(r.adapter)[0] for r in survivors)
    assert max(load.values()) > BALANCE_FACTOR * len(survivors) / 4  # the old bound would have shed
    after = place(survivors, PODS, capacity=1000, previous=before.pods_by_adapter)
    assert all(after.pods_of(r.adapter) == before.pods_of(r.adapter) for r in survivors)
    # Deletes that leave a pod nearly idle do rebalance onto it (the scale-out rule).
    idle = set(on["pod-3"][:35])
    rest = [r for r in requests(200) if r.adapter not in idle]
    moved = place(rest, PODS, capacity=1000, previous=before.pods_by_adapter)
    assert sum(moved.pods_of(r.adapter) != before.pods_of(r.adapter) for r in rest) > 0
