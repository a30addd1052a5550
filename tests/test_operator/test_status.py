from kubelora.operator.conditions import make_condition, merge_conditions
from kubelora.operator.status import Failure, ReplicaState, ReplicaStatus, build_adapter_status, build_pool_status


def replicas(*states):
    return [ReplicaStatus(f"p{i}", s, revision="r" if s is ReplicaState.LOADED else None) for i, s in enumerate(states)]


def reasons(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


LOADED, LOADING = ReplicaState.LOADED, ReplicaState.LOADING


def test_phases_follow_loaded_copies():
    ready = build_adapter_status(generation=3, revision="r", wanted=2, replicas=replicas(LOADED, LOADED))
    assert ready["phase"] == "Ready" and ready["readyReplicas"] == 2 and ready["observedGeneration"] == 3
    assert reasons(ready)["Ready"] == ("True", "AllReplicasLoaded")
    degraded = build_adapter_status(generation=3, revision="r", wanted=2, replicas=replicas(LOADED, LOADING))
    assert degraded["phase"] == "Degraded" and reasons(degraded)["Loaded"] == ("False", "SomeReplicasLoaded")
    assert reasons(degraded)["Ready"][0] == "True"
    loading = build_adapter_status(generation=3, revision="r", wanted=2, replicas=replicas(LOADING, LOADING))
    assert loading["phase"] == "Loading" and reasons(loading)["Ready"] == ("False", "Loading")


def test_capacity_shortage_is_degraded_not_ready():
    status = build_adapter_status(generation=1, revision="r", wanted=3, replicas=replicas(LOADED, LOADED))
    assert status["phase"] == "Degraded" and reasons(status)["Loaded"] == ("False", "InsufficientCapacity")
    nowhere = build_adapter_status(generation=1, revision="r", wanted=1, replicas=[])
    assert nowhere["phase"] == "Loading" and reasons(nowhere)["Ready"] == ("False", "InsufficientCapacity")


def test_failed_and_pending():
    failed = build_adapter_status(generation=1, revision="r", wanted=0, replicas=[],
                                  failure=Failure("AdapterRankTooLarge", "rank 16 > 8"), failed_revision="r")
    assert failed["phase"] == "Failed" and failed["failedRevision"] == "r"
    assert all(c == ("False", "AdapterRankTooLarge") for c in reasons(failed).values())
    pending = build_adapter_status(generation=1, revision="r", wanted=0, replicas=[],
                                   pending=Failure("NoReadyReplicas", "none"))
    assert pending["phase"] == "Pending" and reasons(pending)["Valid"] == ("True", "Validated")


def test_replica_entries_carry_the_served_revision():
    entry = ReplicaStatus("p", LOADED, revision="r1", content_revision="abc", residency="host", loaded_at=0.5,
                          last_error=None).to_dict()
    assert entry == {"pod": "p", "state": "Loaded", "revision": "r1", "contentRevision": "abc",
                     "residency": "host", "loadedAt": "1970-01-01T00:00:00Z"}


def test_pool_ready_condition():
    pods = [{"name": "a", "ready": True}, {"name": "b", "ready": False}]
    status = build_pool_status(generation=2, spec_replicas=2, num_pods=2, pods=pods, selector="s", num_adapters=1,
                               placement_revision=4)
    assert status["readyReplicas"] == 1 and reasons(status)["Ready"] == ("False", "ReplicasNotReady")
    zero = build_pool_status(generation=2, spec_replicas=0, num_pods=0, pods=[], selector="s", num_adapters=0,
                             placement_revision=0)
    assert reasons(zero)["Ready"] == ("True", "ScaledToZero")


def test_transition_time_moves_only_when_status_changes():
    old = merge_conditions([], [make_condition("Ready", True, "A", "m", 1)], now="t0")
    same = merge_conditions(old, [make_condition("Ready", True, "B", "m2", 2)], now="t1")
    flipped = merge_conditions(old, [make_condition("Ready", False, "C", "m", 2)], now="t2")
    assert same[0]["lastTransitionTime"] == "t0" and same[0]["reason"] == "B"
    assert flipped[0]["lastTransitionTime"] == "t2"


def test_status_patch_only_when_something_changed():
    from kubelora.operator.conditions import build_status_patch

    new = {"phase": "Ready", "conditions": [make_condition("Ready", True, "A", "m", 1)]}
    first = build_status_patch({}, new, now="t0")
    assert first["conditions"][0]["lastTransitionTime"] == "t0"
    assert build_status_patch(first, new, now="t1") is None
    assert build_status_patch({**first, "extra": 1}, new) is None  # fields it does not own are ignored
    degraded = build_status_patch(first, {**new, "phase": "Degraded"}, now="t1")
    assert degraded["conditions"][0]["lastTransitionTime"] == "t0"
