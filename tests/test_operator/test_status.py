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


def test_capacity_shortage_is_degraded_not_ready_and_no_room_at_all_is_pending():
    status = build_adapter_status(generation=1, revision="r", wanted=3, replicas=replicas(LOADED, LOADED))
    assert status["phase"] == "Degraded" and reasons(status)["Loaded"] == ("False", "InsufficientCapacity")
    assert reasons(status)["Stalled"] == ("True", "InsufficientCapacity")
    assert reasons(status)["Reconciling"][0] == "False"
    nowhere = build_adapter_status(generation=1, revision="r", wanted=1, replicas=[])
    assert nowhere["phase"] == "Pending" and reasons(nowhere)["Ready"] == ("False", "InsufficientCapacity")
    assert reasons(nowhere)["Stalled"] == ("True", "InsufficientCapacity")


def test_failed_and_pending():
    failed = build_adapter_status(generation=1, revision="r", wanted=0, replicas=[],
                                  failure=Failure("AdapterRankTooLarge", "rank 16 > 8"), failed_revision="r")
    assert failed["phase"] == "Failed" and failed["failedRevision"] == "r"
    assert reasons(failed) == {t: ("False", "AdapterRankTooLarge") for t in ("Valid", "Loaded", "Ready",
                                                                              "Reconciling")} | {
        "Stalled": ("True", "AdapterRankTooLarge")}
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


# ---- kstatus: Ready with observedGeneration, Reconciling while progressing, Stalled when stuck ----

def kstatus_of(status: dict, generation: int) -> str:
    """The kstatus reading of a custom resource (sigs.k8s.io/cli-utils/pkg/kstatus/status, generic rules)."""
    if status.get("observedGeneration") != generation:
        return "InProgress"
    by_type = {c["type"]: c["status"] for c in status["conditions"]}
    if by_type.get("Stalled") == "True":
        return "Failed"
    if by_type.get("Reconciling") == "True":
        return "InProgress"
    return "Current"


def test_adapter_kstatus_follows_the_phase():
    def build(**kwargs):
        return build_adapter_status(generation=4, revision="r", **kwargs)

    cases = [
        (build(wanted=2, replicas=replicas(LOADED, LOADED)), "Current"),
        (build(wanted=2, replicas=replicas(LOADED, LOADING)), "InProgress"),
        (build(wanted=2, replicas=replicas(LOADING, LOADING)), "InProgress"),
        (build(wanted=0, replicas=[], pending=Failure("NoReadyReplicas", "none")), "InProgress"),
        (build(wanted=0, replicas=[], pending=Failure("PoolNotFound", "none")), "InProgress"),
        (build(wanted=1, replicas=[]), "Failed"),  # no room: stuck until capacity is added
        (build(wanted=0, replicas=[], failure=Failure("AdapterCorrupt", "x")), "Failed"),
    ]
    for status, expected in cases:
        assert kstatus_of(status, 4) == expected, status
        assert all(c["observedGeneration"] == 4 for c in status["conditions"])
        assert sum(c["status"] == "True" for c in status["conditions"] if c["type"] in ("Reconciling", "Stalled")) <= 1
    assert kstatus_of(cases[0][0], 5) == "InProgress"  # a newer spec not yet seen


def test_a_retrying_replica_shows_its_error_and_next_retry():
    retrying = ReplicaStatus("p0", ReplicaState.PENDING, last_error="HTTP 404", next_retry_at=60.0)
    status = build_adapter_status(generation=1, revision="r", wanted=1, replicas=[retrying])
    assert status["phase"] == "Loading" and reasons(status)["Ready"] == ("False", "LoadRetrying")
    assert reasons(status)["Reconciling"] == ("True", "LoadRetrying")
    assert status["replicas"] == [{"pod": "p0", "state": "Pending", "lastError": "HTTP 404",
                                   "nextRetryAt": "1970-01-01T00:01:00Z"}]
    assert "next retry at 1970-01-01T00:01:00Z" in status["conditions"][2]["message"]


def test_pool_kstatus():
    pods = [{"name": "a", "ready": True}, {"name": "b", "ready": False}]
    common = {"generation": 2, "num_pods": 2, "selector": "s", "num_adapters": 0, "placement_revision": 0}
    progressing = build_pool_status(spec_replicas=2, pods=pods, **common)
    assert kstatus_of(progressing, 2) == "InProgress" and reasons(progressing)["Reconciling"][0] == "True"
    ready = build_pool_status(spec_replicas=1, pods=pods, **common)
    assert kstatus_of(ready, 2) == "Current" and reasons(ready)["Ready"] == ("True", "AllReplicasReady")
    invalid = build_pool_status(spec_replicas=1, pods=[], invalid=Failure("InvalidSpec", "bad"), **common)
    assert kstatus_of(invalid, 2) == "Failed" and reasons(invalid)["Stalled"] == ("True", "InvalidSpec")
