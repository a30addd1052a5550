"""What a pass publishes and writes, without a cluster (report.py): placement payload, adapter and pool status."""
from __future__ import annotations

import copy
import json

from kubelora.operator.decide import CallResult, Event, plan_pass, record_result
from kubelora.operator.engine_client import EngineError
from kubelora.operator.memory import Published, ReconcileMemory, Refusal, Retry
from kubelora.operator.plan import Load, Unload
from kubelora.operator.report import build_report, held_after, invalid_pool_status, phase_event
from kubelora.operator.status import Failure

from .conftest import POOL, POOL_BODY, adapter, backoff_s, card, view


def run_pass(pool_view, memory=None, results_for=None, now=0.0):
    """plan -> the given results (default: every call succeeds) -> report, as the reconcile runs them."""
    plan, memory = plan_pass(pool_view, memory or ReconcileMemory(), now)
    results = [results_for(a) if results_for else _ok(a) for a in plan.actions]
    for result in results:
        memory, _ = record_result(memory, result, plan, now, backoff_s)
    return plan, build_report(pool_view, plan, results, memory)


def _ok(action):
    if isinstance(action, Unload):
        return CallResult(action)
    return CallResult(action, card={"revision": "c0ffee", "residency": "host" if action.is_preload else "known",
                                    "created": 1})


def test_successful_calls_make_ready_adapters_and_a_new_placement_revision():
    pool_view = view(adapter("a", replicas="all"), adapter("b"))
    plan, report = run_pass(pool_view)
    assert {n: (s["phase"], s["readyReplicas"], s["desiredReplicas"]) for n, s in report.adapter_statuses.items()} \
        == {"a": ("Ready", 2, 2), "b": ("Ready", 1, 1)}
    assert report.placement["revision"] == 1 and report.placement["adapters"]["a"] == ["e0", "e1"]
    assert report.placement["adapters"]["b"] == list(plan.placement.pods_of("b"))
    assert report.memory.published.revision == 1
    assert {r["pod"]: r["revision"] for r in report.adapter_statuses["a"]["replicas"]} == {
        "e0": plan.adapters.desired["a"].source_revision, "e1": plan.adapters.desired["a"].source_revision}
    assert pool_view.observation.adapters == {"e0": {}, "e1": {}}  # the observation is not changed


def test_an_unchanged_placement_is_not_published_again():
    pool_view = view(adapter("a", replicas="all"))
    _, first = run_pass(pool_view)
    payload = json.dumps({k: v for k, v in first.placement.items() if k != "revision"}, sort_keys=True)
    memory = ReconcileMemory(published=Published(1, payload), served=first.memory.served)
    held = {"e0": {"a": card("a", "/adapters/a")}, "e1": {"a": card("a", "/adapters/a")}}
    _, again = run_pass(view(adapter("a", replicas="all"), held=held), memory)
    assert again.placement is None and again.memory.published == Published(1, payload)
    assert again.pool_status["placementRevision"] == 1


def test_the_placement_names_the_holders_whose_copy_is_on_device_for_the_routers_first_tier():
    held = {"e0": {"a": card("a", "/adapters/a", residency="device")},
            "e1": {"a": card("a", "/adapters/a", residency="host"), "b": card("b", "/adapters/b", residency="device")}}
    _, report = run_pass(view(adapter("a", replicas="all"), held=held), ReconcileMemory(published=Published(1, "")))
    assert report.placement["adapters"]["a"] == ["e0", "e1"]
    assert report.placement["onDevice"] == {"a": ["e0"]}  # b is not wanted: not routed, not listed


def test_after_a_restart_the_first_placement_continues_the_stored_revision():
    memory = ReconcileMemory(previous={}, published=Published(7, ""))
    _, report = run_pass(view(adapter("a")), memory)
    assert report.placement["revision"] == 8 and report.pool_status["placementRevision"] == 8


def test_a_refusal_during_the_pass_is_failed_now_with_its_revision_and_pool_spec():
    def refuse(action):
        return CallResult(action, error=EngineError(400, "adapter_rank_too_large", "rank 16 exceeds 8"))

    plan, report = run_pass(view(adapter("big", replicas="all")), results_for=refuse)
    status = report.adapter_statuses["big"]
    assert status["phase"] == "Failed" and status["desiredReplicas"] == 0
    assert status["failedRevision"] == plan.adapters.desired["big"].source_revision
    assert status["failedPoolSpec"] == POOL.fingerprint
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Ready"] == "AdapterRankTooLarge"
    assert report.placement["adapters"] == {"big": []}


def test_a_refused_adapter_still_lists_the_pods_that_hold_it():
    body = adapter("big")
    revision = plan_pass(view(body), ReconcileMemory(), 0.0)[0].adapters.desired["big"].source_revision
    memory = ReconcileMemory(refusals={"big": Refusal(revision, POOL.fingerprint, Failure("X", "old"))})
    held = {"e0": {"big": card("big", "/adapters/big")}, "e1": {}}
    _, report = run_pass(view(body, held=held), memory)
    status = report.adapter_statuses["big"]
    assert status["phase"] == "Failed" and [r["pod"] for r in status["replicas"]] == ["e0"]
    assert report.placement["adapters"] == {"big": ["e0"]}


def test_invalid_adapters_fail_without_a_failed_revision():
    _, report = run_pass(view(adapter("too-big", rank=16)))
    status = report.adapter_statuses["too-big"]
    assert status["phase"] == "Failed" and status["failedRevision"] is None and status["failedPoolSpec"] is None
    assert "too-big" not in report.placement["adapters"]


def test_replicas_backing_off_are_pending_with_their_error_others_loading():
    pool_view = view(adapter("a", replicas="all"))
    plan, memory = plan_pass(pool_view, ReconcileMemory(), 0.0)
    # Only e0's call came back (with a 503); e1's has not been made yet.
    failed = CallResult(next(a for a in plan.actions if a.pod == "e0"), error=EngineError(503, None, "boom"))
    memory, _ = record_result(memory, failed, plan, 0.0, backoff_s)
    report = build_report(pool_view, plan, [failed], memory)
    replicas = {r["pod"]: r for r in report.adapter_statuses["a"]["replicas"]}
    assert replicas["e0"] == {"pod": "e0", "state": "Pending", "lastError": "boom",
                              "nextRetryAt": "1970-01-01T00:00:10Z"}  # now 0.0 + backoff_s(1)
    assert replicas["e1"] == {"pod": "e1", "state": "Loading"}
    status = report.adapter_statuses["a"]
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert status["phase"] == "Loading" and ready["reason"] == "LoadRetrying"
    assert "e0: boom" in ready["message"] and "next retry at 1970-01-01T00:00:10Z" in ready["message"]


def test_no_ready_replica_is_pending():
    _, report = run_pass(view(adapter("a"), held={}))
    status = report.adapter_statuses["a"]
    assert status["phase"] == "Pending"
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Ready"] == "NoReadyReplicas"


def test_deleting_adapters_get_no_status_but_count_in_the_pool():
    gone = adapter("gone")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    held = {"e0": {"gone": card("gone", "/adapters/gone")}, "e1": {}}
    plan, report = run_pass(view(gone, adapter("a"), held=held))
    assert Unload("e0", "gone") in plan.actions and set(report.adapter_statuses) == {"a"}
    assert report.pool_status["numAdapters"] == 2


def test_held_after_applies_successful_calls_to_a_copy():
    held = {"e0": {"old": card("old", "/adapters/old")}, "e1": {}}
    before = copy.deepcopy(held)
    want = plan_pass(view(adapter("a")), ReconcileMemory(), 0.0)[0].adapters.desired["a"]
    results = [CallResult(Unload("e0", "old")),
               CallResult(Load("e1", want, is_preload=True, is_inplace=False), card={"residency": "host"}),
               CallResult(Load("e0", want, is_preload=False, is_inplace=False), error=EngineError(503, None, "x"))]
    after = held_after(held, results)
    assert held == before and set(after["e0"]) == set()
    assert after["e1"]["a"].source == "/adapters/a" and after["e1"]["a"].is_resident


def test_pool_status_lists_each_pod_with_placed_and_loaded_adapters():
    held = {"e0": {"a": card("a", "/adapters/a"), "x": card("x", "/x", "known")}, "e1": {}}
    plan, report = run_pass(view(adapter("a", replicas="all"), held=held))
    pods = {p["name"]: p for p in report.pool_status["pods"]}
    assert pods["e0"]["adapters"] == ["a"] and pods["e0"]["numRegistered"] == 1  # x was unloaded
    assert pods["e1"]["adapters"] == ["a"] and pods["e1"]["freeSlots"] == POOL.engine.max_cpu_loras - 1
    ready = report.pool_status["conditions"][0]
    assert (ready["type"], ready["reason"]) == ("Ready", "AllReplicasReady")


def test_an_invalid_pool_reports_its_reason_and_nothing_else():
    status = invalid_pool_status("p", POOL_BODY, Failure("InvalidSpec", "spec.model.path is required"))
    assert status["pods"] == [] and status["placementRevision"] == 0 and status["numAdapters"] == 0
    assert (status["conditions"][0]["status"], status["conditions"][0]["reason"]) == ("False", "InvalidSpec")


def test_a_phase_change_makes_one_event_warnings_for_failed_and_degraded():
    ready = {"type": "Ready", "reason": "AllReplicasLoaded", "message": "2/2"}
    assert phase_event("a", {"phase": "Loading"}, {"phase": "Ready", "conditions": [ready]}) == Event(
        "a", False, "Ready", "AllReplicasLoaded: 2/2")
    assert phase_event("a", {"phase": "Ready"}, {"phase": "Ready", "conditions": [ready]}) is None
    failed = {"type": "Ready", "reason": "Bad", "message": "m"}
    assert phase_event("a", {}, {"phase": "Failed", "conditions": [failed]}).is_warning
    assert phase_event("a", {}, {"phase": "Degraded", "conditions": [failed]}).is_warning


def test_retries_show_as_the_replica_error_until_they_clear():
    memory = ReconcileMemory(retries={("e0", "a"): Retry(1, 100.0, "boom")})
    _, report = run_pass(view(adapter("a", replicas="all")), memory, now=0.0)
    replicas = {r["pod"]: r["state"] for r in report.adapter_statuses["a"]["replicas"]}
    assert replicas == {"e0": "Pending", "e1": "Loaded"}  # e0's call waits for its backoff


def test_an_adapter_no_pod_has_room_for_is_pending_and_the_pool_says_what_is_missing():
    from kubelora.operator.plan import ObservedAdapter

    def sized(name, num_bytes, residency="known"):
        return ObservedAdapter(name, f"/adapters/{name}", None, "c0ffee", residency, num_bytes=num_bytes)

    held = {"e0": {"a": sized("a", 60), "b": sized("b", 60)}, "e1": {"a": sized("a", 60), "b": sized("b", 60)}}
    pool_view = view(adapter("a", replicas="all"), adapter("b"), held=held)
    pool_view.observation.budgets.update({"e0": 100, "e1": 100})
    plan, report = run_pass(pool_view)
    assert plan.placement.pods_of("b") == () and plan.sizes == {"a": 60, "b": 60}
    status = report.adapter_statuses["b"]
    ready = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Pending" and ready["Ready"]["reason"] == "InsufficientCapacity"
    assert ready["Stalled"]["status"] == "True" and "60 bytes" in ready["Ready"]["message"]
    assert report.pool_status["capacityShortage"] == {"numAdapters": 1, "numCopies": 1, "bytes": 60}
    pods = {p["name"]: p for p in report.pool_status["pods"]}
    assert pods["e0"]["adapterBudgetBytes"] == 100 and pods["e0"]["freeBytes"] == 40
    # The phase change to Pending for lack of room is a Warning event.
    event = phase_event("b", {"phase": "Loading"}, status)
    assert event.is_warning and event.reason == "Pending"
