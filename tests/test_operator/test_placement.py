from collections import Counter

from kubelora.operator.placement import PlacementRequest, place, rank_pods

PODS = [f"pod-{i}" for i in range(4)]


def requests(n, replicas=1):
    return [PlacementRequest(f"a{i}", replicas) for i in range(n)]


def test_k_copies_on_the_best_ranked_pods_deterministically():
    placement = place(requests(3, replicas=2), PODS, capacity=10)
    for i in range(3):
        assert placement.pods_of(f"a{i}") == tuple(rank_pods(f"a{i}", PODS)[:2])
    assert place(requests(3, replicas=2), reversed(PODS), capacity=10) == placement


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


def test_scale_out_keeps_current_holders():
    before = place(requests(20), PODS[:2], capacity=100)
    after = place(requests(20), PODS, capacity=100, previous=before.pods_by_adapter)
    assert after.pods_by_adapter == before.pods_by_adapter


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
