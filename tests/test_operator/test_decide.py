"""The reconcile's decisions without a cluster: classification, refusals, retries and load results (decide.py).

Every function here is pure: the tests hand in what a pass read and a memory, and check what comes back and
that nothing handed in changed.
"""
from __future__ import annotations

import copy
import time
from dataclasses import replace

from kubelora.contract.load import S3Access
from kubelora.operator.decide import (CallResult, Event, StoredPlacement, classify_adapters, freeze_new_failures,
                                      plan_pass, record_result, standing_refusal)
from kubelora.operator.engine_client import EngineError
from kubelora.operator.memory import Published, ReconcileMemory, Refusal, Retry
from kubelora.operator.plan import DesiredAdapter, Load, Unload
from kubelora.operator.specs import PoolSpec
from kubelora.operator.status import Failure

from .conftest import POOL, POOL_BODY, REFUSED, adapter, backoff_s, card, view


def revision_of(body: dict) -> str:
    return classify_adapters(view(body), ReconcileMemory())[0].desired[body["metadata"]["name"]].source_revision


# ---- classification ----

def test_adapters_are_sorted_into_invalid_blocked_refused_and_desired():
    refused = adapter("refused")
    bodies = [adapter("ok"), adapter("too-big", rank=16), adapter("outside", "/etc/x"),
              adapter("private", "/unused"), refused, adapter("deleting")]
    bodies[3]["spec"]["source"] = {"url": "https://models.example/x", "authSecretRef": {"name": "creds"}}
    bodies[5]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    memory = ReconcileMemory(refusals={"refused": Refusal(revision_of(refused), POOL.fingerprint, REFUSED)})
    adapters, after = classify_adapters(view(*bodies), memory)
    assert set(adapters.desired) == {"ok"} and [r.adapter for r in adapters.requests] == ["ok"]
    assert {n: f.reason for n, f in adapters.invalid.items()} == {"too-big": "RankTooHigh",
                                                                   "outside": "PathNotAllowed"}
    assert adapters.blocked["private"].reason == "SecretNotFound" and "ns/creds" in adapters.blocked["private"].message
    assert adapters.frozen == {"refused": REFUSED}
    assert set(adapters.left_alone()) == {"refused", "private"} and after.refusals == memory.refusals


def test_a_token_unblocks_and_travels_with_the_desired_adapter():
    private = adapter("private")
    private["spec"]["source"] = {"url": "https://models.example/x", "authSecretRef": {"name": "creds"}}
    adapters, _ = classify_adapters(view(private, tokens={"private": "tok"}), ReconcileMemory())
    assert adapters.desired["private"].auth_token == "tok" and not adapters.blocked


def test_refusals_of_adapters_that_are_gone_are_forgotten():
    memory = ReconcileMemory(refusals={"gone": Refusal("r", POOL.fingerprint, REFUSED)})
    _, after = classify_adapters(view(adapter("ok")), memory)
    assert after.refusals == {}


def test_served_revisions_are_read_back_from_the_status_but_memory_wins():
    status = {"replicas": [{"pod": "e0", "state": "Loaded", "revision": "r-status"},
                           {"pod": "e1", "state": "Loaded", "revision": "r-status"},
                           {"pod": "e2", "state": "Loading"}, {"pod": "e9", "state": "Loaded", "revision": "x"}]}
    memory = ReconcileMemory(served={("e1", "a"): "r-memory"})
    _, after = plan_pass(view(adapter("a", status=status), held={"e0": {}, "e1": {}, "e2": {}}), memory, now=0.0)
    # e9 is not a pod of the pool any more: forgotten with the pod.
    assert after.served == {("e0", "a"): "r-status", ("e1", "a"): "r-memory"}


# ---- permanent failure memory ----

def test_a_remembered_refusal_holds_for_its_revision_and_pool_only():
    refusal = Refusal("r1", "fp1", REFUSED)
    assert standing_refusal({}, "r1", "fp1", refusal) is refusal
    assert standing_refusal({}, "r2", "fp1", refusal) is None  # a new source: try once more
    assert standing_refusal({}, "r1", "fp2", refusal) is None  # a changed pool: try once more


def test_after_a_restart_the_status_tells_which_revision_was_refused():
    ready = {"type": "Ready", "status": "False", "reason": "Sha256Mismatch", "message": "pod e0: digest"}
    body = {"status": {"failedRevision": "r1", "failedPoolSpec": "fp1", "conditions": [ready]}}
    assert standing_refusal(body, "r1", "fp1", None) == Refusal("r1", "fp1", Failure("Sha256Mismatch",
                                                                                     "pod e0: digest"))
    assert standing_refusal(body, "r2", "fp1", None) is None
    assert standing_refusal(body, "r1", "fp2", None) is None
    older = {"status": {"failedRevision": "r1", "conditions": [ready]}}  # written before failedPoolSpec existed
    assert standing_refusal(older, "r1", "fp2", None).pool_fingerprint == "fp2"
    # A stale memory entry is not overruled by the status: the pass that dropped it tries once.
    assert standing_refusal(body, "r1", "fp1", Refusal("r0", "fp1", REFUSED)) is None


def test_a_refused_adapter_is_left_alone_on_every_pod():
    body = adapter("big")
    memory = ReconcileMemory(refusals={"big": Refusal(revision_of(body), POOL.fingerprint, REFUSED)})
    held = {"e0": {"big": card("big", "/adapters/big")}, "e1": {}}
    plan, _ = plan_pass(view(body, held=held), memory, now=0.0)
    assert plan.actions == () and plan.adapters.frozen == {"big": REFUSED}


def test_refusals_recorded_during_a_pass_freeze_the_adapter_at_once():
    adapters, _ = classify_adapters(view(adapter("big"), adapter("ok")), ReconcileMemory())
    want = adapters.desired["big"]
    refusals = {"big": Refusal(want.source_revision, POOL.fingerprint, REFUSED),
                "ok": Refusal("another-revision", POOL.fingerprint, REFUSED)}
    frozen = freeze_new_failures(adapters, refusals, POOL.fingerprint)
    assert set(frozen.desired) == {"ok"} and frozen.frozen == {"big": REFUSED}
    assert set(adapters.desired) == {"big", "ok"}  # the input is not changed


# ---- planning and retries ----

def test_a_pass_places_plans_and_remembers_the_placement():
    plan, after = plan_pass(view(adapter("a", replicas="all"), adapter("b")), ReconcileMemory(), now=0.0)
    assert plan.placement.pods_of("a") == ("e0", "e1") and len(plan.placement.pods_of("b")) == 1
    loads = sorted((a.pod, a.adapter.name, a.is_preload) for a in plan.actions)
    placed_b = plan.placement.pods_of("b")[0]
    assert loads == sorted([("e0", "a", True), ("e1", "a", True), ("e0", "b", placed_b == "e0"),
                            ("e1", "b", placed_b == "e1")])
    assert after.previous == plan.placement.pods_by_adapter and plan.stale_pods == frozenset()


def test_the_stored_placement_is_the_previous_one_after_a_restart():
    stored = StoredPlacement.from_configmap({"data": {"placement.json": '{"revision": 7, "adapters": {"b": ["e1"]}}'}})
    plan, after = plan_pass(view(adapter("b"), stored=stored), ReconcileMemory(), now=0.0)
    assert plan.placement.pods_of("b") == ("e1",)
    assert after.published == Published(7, "")
    assert StoredPlacement.from_configmap(None) == StoredPlacement({}, 0)
    assert StoredPlacement.from_configmap({"data": {"placement.json": "not json"}}) == StoredPlacement({}, 0)
    # Once a placement is remembered, the stored one is ignored.
    again, _ = plan_pass(view(adapter("b"), stored=StoredPlacement({"b": ("e0",)}, 9)), after, now=0.0)
    assert again.placement.pods_of("b") == ("e1",)


def test_calls_backing_off_wait_and_retries_of_gone_pods_are_dropped():
    memory = ReconcileMemory(retries={("e0", "a"): Retry(1, 5.0, "boom"), ("gone", "a"): Retry(3, 99.0, "x")})
    early, after = plan_pass(view(adapter("a", replicas="all")), memory, now=4.0)
    assert [(a.pod, a.adapter.name) for a in early.actions] == [("e1", "a")]
    assert set(after.retries) == {("e0", "a")}
    late, _ = plan_pass(view(adapter("a", replicas="all")), memory, now=5.0)
    assert sorted(a.pod for a in late.actions) == ["e0", "e1"]


def test_pods_of_an_older_pool_spec_are_stale_and_strangers_are_unloaded():
    held = {"e0": {"manual": card("manual", "/x")}, "e1": {}}
    plan, _ = plan_pass(view(held=held, stale=("e1",)), ReconcileMemory(), now=0.0)
    assert plan.stale_pods == frozenset({"e1"}) and plan.actions == (Unload("e0", "manual"),)


def test_planning_changes_neither_the_view_nor_the_memory():
    pool_view = view(adapter("a", status={"replicas": [{"pod": "e0", "state": "Loaded", "revision": "r"}]}),
                     held={"e0": {"x": card("x", "/x")}, "e1": {}})
    memory = ReconcileMemory(retries={("gone", "a"): Retry(1, 1.0, "m")})
    before = copy.deepcopy((pool_view, memory))
    plan_pass(pool_view, memory, now=0.0)
    assert (pool_view, memory) == before


# ---- load results ----

A = DesiredAdapter("a", "/adapters/a", None, "rev-a")


def plan_for(stale=()):
    plan, _ = plan_pass(view(adapter("a"), stale=stale), ReconcileMemory(), now=0.0)
    return plan


def test_a_load_records_what_it_served_and_clears_the_backoff():
    memory = ReconcileMemory(retries={("e0", "a"): Retry(2, 1.0, "boom")})
    result = CallResult(Load("e0", A, is_preload=True, is_inplace=False), card={"revision": "c0ffee"})
    after, events = record_result(memory, result, plan_for(), now=3.0, backoff_s=backoff_s)
    assert after.served == {("e0", "a"): "rev-a"} and after.retries == {}
    assert events == [Event("a", False, "Loaded", "revision rev-a (content c0ffee) on pod e0, preload=True")]
    assert memory.retries == {("e0", "a"): Retry(2, 1.0, "boom")}  # the input memory stays as it was


def test_in_place_loads_say_reloaded_and_registrations_say_nothing():
    reload = CallResult(Load("e0", A, is_preload=False, is_inplace=True), card={})
    _, events = record_result(ReconcileMemory(), reload, plan_for(), now=0.0, backoff_s=backoff_s)
    assert [e.reason for e in events] == ["Reloaded"]
    register = CallResult(Load("e1", A, is_preload=False, is_inplace=False), card={})
    after, events = record_result(ReconcileMemory(), register, plan_for(), now=0.0, backoff_s=backoff_s)
    assert events == [] and after.served == {("e1", "a"): "rev-a"}


def test_an_unload_forgets_what_was_served_there():
    memory = ReconcileMemory(served={("e0", "a"): "rev-a", ("e1", "a"): "rev-a"})
    after, events = record_result(memory, CallResult(Unload("e0", "a")), plan_for(), now=0.0, backoff_s=backoff_s)
    assert after.served == {("e1", "a"): "rev-a"}
    assert events == [Event("a", False, "Unloaded", "unloaded from pod e0")]


def test_unloads_over_a_fleet_sized_memory_cost_a_copy_each_not_a_scan():
    """A bulk delete records one unload per adapter and pod into a memory holding every (pod, adapter) of the pool:
    each must stay a clone of the table (about 0.15 ms here for 40,000 entries), not a re-insertion of every entry
    (1.2 ms) or a Python-level filter (3 ms)."""
    served = {(f"e{p}", f"a{i}"): "rev" for p in range(16) for i in range(2500)}
    memory, plan = ReconcileMemory(served=served), plan_for()
    started = time.perf_counter()
    for i in range(1000):
        memory, _ = record_result(memory, CallResult(Unload("e3", f"a{i}")), plan, now=0.0, backoff_s=backoff_s)
    assert time.perf_counter() - started < 1.0  # a re-insertion takes over 1.2 s, a filter over 3 s
    assert len(memory.served) == 39000 and ("e3", "a0") not in memory.served and ("e2", "a0") in memory.served
    assert len(served) == 40000  # the input memory stays as it was


def test_a_400_from_a_current_pod_is_a_refusal_of_that_revision_under_this_pool():
    error = EngineError(400, "adapter_rank_too_large", "r: rank 16 exceeds max_lora_rank 8")
    result = CallResult(Load("e0", A, is_preload=True, is_inplace=False), error=error)
    after, events = record_result(ReconcileMemory(), result, plan_for(), now=0.0, backoff_s=backoff_s)
    failure = Failure("AdapterRankTooLarge", "pod e0: r: rank 16 exceeds max_lora_rank 8")
    assert after.refusals == {"a": Refusal("rev-a", POOL.fingerprint, failure)} and after.retries == {}
    assert events == [Event("a", True, "LoadFailed", f"AdapterRankTooLarge: {failure.message}")]


def test_a_400_from_a_pod_being_rolled_out_is_retried_not_final():
    error = EngineError(400, "adapter_rank_too_large", "too big")
    result = CallResult(Load("e1", A, is_preload=True, is_inplace=False), error=error)
    after, events = record_result(ReconcileMemory(), result, plan_for(stale=("e1",)), now=2.0, backoff_s=backoff_s)
    assert after.refusals == {} and after.retries == {("e1", "a"): Retry(1, 12.0, "too big")}
    assert [(e.is_warning, e.reason) for e in events] == [(True, "LoadFailed")]


def test_transient_failures_back_off_longer_and_warn_once_per_series():
    result = CallResult(Load("e0", A, is_preload=True, is_inplace=False), error=EngineError(503, None, "boom"))
    memory, events = record_result(ReconcileMemory(), result, plan_for(), now=0.0, backoff_s=backoff_s)
    assert memory.retries[("e0", "a")] == Retry(1, 10.0, "boom") and len(events) == 1
    assert "retrying with backoff" in events[0].message
    memory, events = record_result(memory, result, plan_for(), now=10.0, backoff_s=backoff_s)
    assert memory.retries[("e0", "a")] == Retry(2, 30.0, "boom") and events == []
    assert memory.refusals == {}


def test_a_failed_unload_is_retried_with_its_own_event():
    result = CallResult(Unload("e0", "old"), error=EngineError(None, None, "connection refused"))
    after, events = record_result(ReconcileMemory(), result, plan_for(), now=0.0, backoff_s=backoff_s)
    assert set(after.retries) == {("e0", "old")} and [e.reason for e in events] == ["UnloadFailed"]
    # An unload refused with a 400 is not a refusal of anything: only loads are.
    refused = CallResult(Unload("e0", "old"), error=EngineError(400, "bad", "no"))
    after, _ = record_result(ReconcileMemory(), refused, plan_for(), now=0.0, backoff_s=backoff_s)
    assert after.refusals == {} and set(after.retries) == {("e0", "old")}


# ---- transient load failures heal; a retry can be asked for ----

def test_a_400_the_engine_calls_retryable_backs_off_instead_of_failing():
    missing = EngineError(400, "path_not_found", "lora_path '/adapters/a' is not a directory", is_retryable=True)
    corrupt = EngineError(400, "adapter_corrupt", "cannot parse", is_retryable=False)
    legacy = EngineError(400, "adapter_corrupt", "cannot parse")  # an engine that does not say
    assert not missing.is_permanent and corrupt.is_permanent and legacy.is_permanent
    result = CallResult(Load("e0", A, is_preload=True, is_inplace=False), error=missing)
    after, events = record_result(ReconcileMemory(), result, plan_for(), now=0.0, backoff_s=backoff_s)
    assert after.refusals == {} and after.retries == {("e0", "a"): Retry(1, 10.0, str(missing))}
    assert [(e.is_warning, e.reason) for e in events] == [(True, "LoadFailed")]
    # The file shows up: the next try after the backoff loads it and clears the retry.
    plan, memory = plan_pass(view(adapter("a")), after, now=10.0)
    assert [a.pod for a in plan.actions if isinstance(a, Load) and a.is_preload] == ["e0"]
    ok = CallResult(next(a for a in plan.actions if a.pod == "e0"), card={"revision": "c0ffee"})
    healed, _ = record_result(memory, ok, plan, now=10.0, backoff_s=backoff_s)
    assert healed.retries == {}


def _retried(body: dict) -> dict:
    return {**body, "metadata": {**body["metadata"], "annotations": {"kubelora.io/retry": "1"}}}


def test_a_new_retry_request_lifts_a_refusal_once():
    body = adapter("big")
    refusal = Refusal(revision_of(body), POOL.fingerprint, REFUSED)
    adapters, _ = classify_adapters(view(_retried(body)), ReconcileMemory(refusals={"big": refusal}))
    assert "big" in adapters.desired and adapters.retry_requests == {"big": "1"}
    # The retry is refused again: that refusal holds while the annotation stays "1".
    error = EngineError(400, "adapter_rank_too_large", "too big", is_retryable=False)
    plan, memory = plan_pass(view(_retried(body)), ReconcileMemory(refusals={"big": refusal}), now=0.0)
    load = next(a for a in plan.actions if isinstance(a, Load) and a.is_preload)
    memory, _ = record_result(memory, CallResult(load, error=error), plan, now=0.0, backoff_s=backoff_s)
    assert memory.refusals["big"].retry_request == "1"
    again, _ = classify_adapters(view(_retried(body)), memory)
    assert "big" in again.frozen and "big" not in again.desired


def test_after_a_restart_the_status_tells_which_retry_request_was_answered():
    ready = {"type": "Ready", "status": "False", "reason": "AdapterCorrupt", "message": "m"}
    status = {"failedRevision": "r1", "failedPoolSpec": "fp1", "retryRequest": "1", "conditions": [ready]}
    assert standing_refusal({"status": status}, "r1", "fp1", None, "1") is not None
    assert standing_refusal({"status": status}, "r1", "fp1", None, "2") is None
    assert standing_refusal({"status": status}, "r1", "fp1", None, "") is None


def test_a_new_retry_request_cuts_a_backoff_short():
    memory = ReconcileMemory(retries={("e0", "a"): Retry(5, 500.0, "HTTP 404")})
    waiting, _ = plan_pass(view(adapter("a", replicas="all")), memory, now=1.0)
    assert [a.pod for a in waiting.actions] == ["e1"]
    asked, after = plan_pass(view(_retried(adapter("a", replicas="all"))), memory, now=1.0)
    assert sorted(a.pod for a in asked.actions) == ["e0", "e1"] and after.retries == {}


# ---- declared rank and targets against the files ----

def _declared(rank=None, targets=()):
    return DesiredAdapter("a", "/adapters/a", None, "rev-a", declared_rank=rank, declared_targets=tuple(targets))


def test_a_load_whose_files_contradict_spec_rank_is_refused_and_unloaded_next_pass():
    body = adapter("a", rank=8)
    plan, memory = plan_pass(view(body), ReconcileMemory(), now=0.0)
    load = next(a for a in plan.actions if isinstance(a, Load) and a.is_preload)
    assert load.adapter.declared_rank == 8
    card_ = {"revision": "c0ffee", "residency": "host", "rank": 4, "targets": ["q_proj", "v_proj"]}
    memory, events = record_result(memory, CallResult(load, card=card_), plan, now=0.0, backoff_s=backoff_s)
    refusal = memory.refusals["a"]
    assert refusal.failure.reason == "RankMismatch" and "spec.rank is 8" in refusal.failure.message
    assert "rank 4" in refusal.failure.message and [e.reason for e in events] == ["LoadFailed"]
    assert freeze_new_failures(plan.adapters, memory.refusals, POOL.fingerprint).mismatched == {"a": refusal.failure}
    held = {"e0": {"a": card("a", "/adapters/a")}, "e1": {"a": card("a", "/adapters/a", "known")}}
    after, _ = plan_pass(view(body, held=held), memory, now=1.0)
    assert sorted(after.actions, key=str) == [Unload("e0", "a"), Unload("e1", "a")]
    assert after.adapters.mismatched == {"a": refusal.failure} and after.adapters.frozen == {}


def test_declared_targets_are_compared_as_sets_and_matching_declarations_pass():
    from kubelora.operator.validation import check_declared

    assert check_declared("a", 4, ("v_proj", "q_proj"), 4, ("q_proj", "v_proj"), "pod e0") is None
    assert check_declared("a", None, (), 4, ("q_proj",), "pod e0") is None  # nothing declared, nothing checked
    assert check_declared("a", 4, ("q_proj",), None, None, "pod e0") is None  # nothing reported
    wrong = check_declared("a", None, ("q_proj", "k_proj"), 4, ("q_proj", "v_proj"), "pod e0")
    assert wrong.reason == "TargetsMismatch" and "['k_proj', 'q_proj']" in wrong.message
    # a fused module is reported as the projections it spans
    assert check_declared("a", None, ("qkv_proj", "o_proj"), 4, ("q_proj", "k_proj", "v_proj", "o_proj"), "e0") is None
    assert check_declared("a", None, ("qkv_proj",), 4, ("q_proj", "v_proj"), "e0").reason == "TargetsMismatch"


def test_an_observed_copy_that_contradicts_the_spec_is_refused_without_any_call():
    from kubelora.operator.plan import ObservedAdapter

    body = adapter("a", targets=["q_proj", "k_proj"])
    have = ObservedAdapter("a", "/adapters/a", None, "c0ffee", "host", rank=4, targets=("q_proj", "v_proj"))
    adapters, memory = classify_adapters(view(body, held={"e0": {"a": have}, "e1": {}}), ReconcileMemory())
    assert adapters.mismatched["a"].reason == "TargetsMismatch" and "a" not in adapters.desired
    assert memory.refusals["a"].failure == adapters.mismatched["a"]
    # After an operator restart the status (failedRevision, Ready reason) keeps it refused, and unloaded.
    ready = {"type": "Ready", "status": "False", "reason": "TargetsMismatch", "message": "m"}
    status = {"failedRevision": revision_of(body), "failedPoolSpec": POOL.fingerprint, "conditions": [ready],
              "observedGeneration": 1}
    restarted, _ = classify_adapters(view(adapter("a", targets=["q_proj", "k_proj"], status=status)),
                                     ReconcileMemory())
    assert set(restarted.mismatched) == {"a"} and not restarted.frozen
    # A corrected spec (a new generation, same source) is checked afresh against what the pods hold, whether the
    # refusal is remembered or read back from the status.
    fixed_body = adapter("a", targets=["q_proj", "v_proj"], status=status)
    fixed_body["metadata"]["generation"] = 2
    for remembered in (memory, ReconcileMemory()):
        fixed, _ = classify_adapters(view(fixed_body, held={"e0": {"a": have}, "e1": {}}), remembered)
        assert "a" in fixed.desired and not fixed.mismatched
    unchanged = adapter("a", targets=["q_proj", "k_proj"], status=status)
    assert set(classify_adapters(view(unchanged), memory)[0].mismatched) == {"a"}  # no new call needed


def test_an_s3_source_gets_the_secrets_keys_with_the_specs_endpoint_over_the_secrets():
    s3_pool = {**POOL_BODY, "spec": {**POOL_BODY["spec"], "adapterS3Buckets": ["team-a"],
                                     "adapterS3Endpoints": ["http://minio:9000", "http://other:9000"]}}
    private, public = adapter("private"), adapter("public")
    private["spec"]["source"] = {"url": "s3://team-a/x.tar.gz", "authSecretRef": {"name": "s3-creds"},
                                 "s3": {"endpoint": "http://minio:9000"}}
    public["spec"]["source"] = {"url": "s3://team-a/y/", "s3": {"region": "eu-west-1"}}
    secret = S3Access.from_secret_data({"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK",
                                        "AWS_ENDPOINT_URL": "http://other:9000", "AWS_REGION": "us-west-2"})
    pool_view = replace(view(private, public, tokens={"private": secret}), pool_body=s3_pool,
                        pool=PoolSpec.from_body(s3_pool))
    adapters, _ = classify_adapters(pool_view, ReconcileMemory())
    assert not adapters.blocked and not adapters.invalid, (adapters.blocked, adapters.invalid)
    assert adapters.desired["private"].s3.as_payload() == {
        "endpoint": "http://minio:9000", "region": "us-west-2", "access_key_id": "AK", "secret_access_key": "SK"}
    assert adapters.desired["private"].auth_token is None
    # No Secret named: the engine's default credential chain (web identity), with the spec's settings only.
    assert adapters.desired["public"].s3.as_payload() == {"region": "eu-west-1"}
    assert "SK" not in repr(adapters.desired["private"]) and "SK" not in repr(secret)
    # A Secret without the key pair blocks the adapter, naming the keys it needs.
    incomplete = S3Access.from_secret_data({"AWS_ACCESS_KEY_ID": "AK"})
    pool_view = replace(pool_view, tokens={"private": incomplete})
    adapters, _ = classify_adapters(pool_view, ReconcileMemory())
    assert incomplete is None and adapters.blocked["private"].reason == "SecretNotFound"
    assert "AWS_SECRET_ACCESS_KEY" in adapters.blocked["private"].message
