"""Ready means routable, stale placement, without a cluster: an adapter is Ready once every ready router
took a placement revision listing it; a router behind for over 10 s makes the pool Degraded/RouterPlacementStale."""
from __future__ import annotations

from kubelora.operator.decide import plan_pass, record_result
from kubelora.operator.memory import ReconcileMemory
from kubelora.operator.observe import RouterAck
from kubelora.operator.report import build_publication, report_publication
from kubelora.operator.routers import (RECHECK_BEHIND_S, RECHECK_STALE_S, ROUTER_PLACEMENT_STALE, RouterView,
                                       judge_routers, remember_revisions)

from .conftest import adapter, backoff_s, view
from .test_report import _ok


def publish(pool_view, memory=None, now=0.0):
    plan, memory = plan_pass(pool_view, memory or ReconcileMemory(), now)
    results = [_ok(a) for a in plan.actions]
    for result in results:
        memory, _ = record_result(memory, result, plan, now, backoff_s)
    return plan, build_publication(pool_view, plan, results, memory)


def ack(pod: str, revision: int | None, *, is_ready: bool = True, age_s: float = 0.1, error=None) -> RouterAck:
    return RouterAck(pod, "10.0.0.9", is_ready, revision=revision, age_s=None if revision is None else age_s,
                     loaded_at=1_800_000_000.0 if revision is not None else None, error=error)


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_a_loaded_adapter_waits_for_every_ready_router():
    pool_view = view(adapter("a"))
    plan, publication = publish(pool_view)
    assert publication.revision == 1 and publication.memory.included == {"a": 1}
    behind = RouterView({"r0": ack("r0", 1), "r1": ack("r1", 0)}, now=100.0)
    report = report_publication(pool_view, plan, publication, behind)
    status = report.adapter_statuses["a"]
    assert status["phase"] == "Loading" and status["readyReplicas"] == 1
    assert conditions(status)["Ready"] == ("False", "WaitingForRouters")
    assert conditions(status)["Loaded"] == ("True", "AllReplicasLoaded")
    assert conditions(status)["Reconciling"][0] == "True"
    ready_message = next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
    assert "r1 (revision 0)" in ready_message and "r0" not in ready_message
    assert report.memory.routers_behind == {"r1": 100.0} and report.next_pass_s == RECHECK_BEHIND_S

    taken = RouterView({"r0": ack("r0", 1), "r1": ack("r1", 1)}, now=100.5)
    report = report_publication(pool_view, plan, publication, taken)
    assert report.adapter_statuses["a"]["phase"] == "Ready" and report.next_pass_s is None
    routers = report.pool_status["routers"]
    assert [(r["name"], r["revision"], r["stale"]) for r in routers] == [("r0", 1, False), ("r1", 1, False)]
    assert routers[0]["acknowledgedAt"] == "2027-01-15T08:00:00Z"


def test_routers_that_are_not_ready_or_absent_do_not_hold_adapters_back():
    pool_view = view(adapter("a"))
    plan, publication = publish(pool_view)
    for routers in (RouterView(now=1.0), RouterView({"r0": ack("r0", None, is_ready=False)}, now=1.0)):
        assert report_publication(pool_view, plan, publication, routers).adapter_statuses["a"]["phase"] == "Ready"


def test_an_adapter_stays_included_from_the_revision_that_first_listed_it():
    """Another adapter's change publishes a new revision: a router still on the older one routes `a` already,
    so `a` stays Ready; the new adapter waits for that router."""
    first_view = view(adapter("a"))
    plan, first = publish(first_view)
    memory = report_publication(first_view, plan, first, RouterView({"r0": ack("r0", 1)}, now=1.0)).memory
    second_view = view(adapter("a"), adapter("b"), held={"e0": {}, "e1": {}})
    plan, second = publish(second_view, memory)
    assert second.revision == 2 and second.memory.included == {"a": 1, "b": 2}
    report = report_publication(second_view, plan, second, RouterView({"r0": ack("r0", 1)}, now=2.0))
    assert report.adapter_statuses["a"]["phase"] == "Ready"
    assert report.adapter_statuses["b"]["phase"] == "Loading"


def test_a_router_behind_for_over_10_s_degrades_the_pool():
    routers = {"r0": ack("r0", 6, error="configmap ns/p-placement: HTTP 403 Forbidden"), "r1": ack("r1", 9)}
    early = judge_routers(RouterView(routers, now=100.0), 9, {})
    assert early.degraded is None and early.behind == {"r0": 100.0} and early.next_pass_s == RECHECK_BEHIND_S
    late = judge_routers(RouterView(routers, now=110.5), 9, early.behind)
    assert late.degraded.reason == ROUTER_PLACEMENT_STALE and late.next_pass_s == RECHECK_STALE_S
    assert "router r0 routes on revision 6" in late.degraded.message and "403" in late.degraded.message
    assert "r1" not in late.degraded.message
    entry = next(e for e in late.entries if e["name"] == "r0")
    assert entry["stale"] and entry["lastError"].endswith("403 Forbidden") and "behindSince" in entry
    caught_up = judge_routers(RouterView({**routers, "r0": ack("r0", 9)}, now=111.0), 9, late.behind)
    assert caught_up.degraded is None and caught_up.behind == {} and caught_up.next_pass_s is None


def test_a_router_that_cannot_read_its_placement_is_stale_before_any_change():
    """Nothing was published since, so it is not behind; its own placement age says it cannot refresh."""
    judgement = judge_routers(RouterView({"r0": ack("r0", 9, age_s=12.0)}, now=5.0), 9, {})
    assert judgement.degraded.reason == ROUTER_PLACEMENT_STALE and judgement.behind == {}
    assert judgement.entries[0]["placementAgeSeconds"] == 12


def test_a_router_that_does_not_answer_counts_as_behind():
    first = judge_routers(RouterView({"r0": ack("r0", None)}, now=0.0), 3, {})
    assert first.behind == {"r0": 0.0} and first.degraded is None
    assert judge_routers(RouterView({"r0": ack("r0", None)}, now=11.0), 3, first.behind).degraded is not None


def test_pool_status_carries_routers_and_a_degraded_condition():
    pool_view = view(adapter("a"))
    plan, publication = publish(pool_view)
    memory = publication.memory
    stale = ack("r0", 0, error="configmap ns/p-placement: HTTP 403 Forbidden")
    from dataclasses import replace
    publication = replace(publication, memory=replace(memory, routers_behind={"r0": 0.0}))
    report = report_publication(pool_view, plan, publication, RouterView({"r0": stale}, now=30.0))
    pool = report.pool_status
    assert conditions(pool)["Degraded"] == ("True", ROUTER_PLACEMENT_STALE)
    assert conditions(pool)["Ready"] == ("True", "AllReplicasReady")  # the engines are fine
    healthy = report_publication(pool_view, plan, publication, RouterView(now=30.0)).pool_status
    assert conditions(healthy)["Degraded"] == ("False", "RoutersCurrent") and healthy["routers"] == []


def _two_routers_took(pool_view, plan, publication, now=1.0):
    return report_publication(pool_view, plan, publication,
                              RouterView({"r0": ack("r0", publication.revision), "r1": ack("r1", publication.revision)},
                                         now=now)).memory


def test_a_router_that_stops_answering_keeps_what_it_acknowledged_routable():
    """Its last acknowledged revision lists `a`: `a` stays Ready; the router alone degrades the pool (once it has
    not answered for over 10 s), also when it is the pool's only router."""
    pool_view = view(adapter("a"))
    plan, publication = publish(pool_view)
    memory = _two_routers_took(pool_view, plan, publication)
    assert memory.router_revisions == {"r0": 1, "r1": 1}
    plan, publication = publish(pool_view, memory, now=2.0)
    silent = {"r0": ack("r0", 1), "r1": ack("r1", None, error="GET /placement: ServerDisconnectedError")}
    report = report_publication(pool_view, plan, publication, RouterView(silent, now=2.0))
    assert report.adapter_statuses["a"]["phase"] == "Ready" and report.memory.router_revisions == {"r0": 1, "r1": 1}
    assert conditions(report.pool_status)["Degraded"] == ("False", "RoutersCurrent")
    plan, publication = publish(pool_view, report.memory, now=13.0)
    report = report_publication(pool_view, plan, publication, RouterView(silent, now=13.0))
    assert report.adapter_statuses["a"]["phase"] == "Ready"
    assert conditions(report.pool_status)["Degraded"] == ("True", ROUTER_PLACEMENT_STALE)
    alone = report_publication(pool_view, plan, publication, RouterView({"r1": silent["r1"]}, now=13.0))
    assert alone.adapter_statuses["a"]["phase"] == "Ready"


def test_a_new_adapter_is_ready_once_an_answering_router_routes_it_despite_a_silent_one():
    first_view = view(adapter("a"))
    plan, first = publish(first_view)
    memory = _two_routers_took(first_view, plan, first)
    second_view = view(adapter("a"), adapter("b"))
    plan, second = publish(second_view, memory, now=2.0)
    assert second.memory.included["b"] == 2
    silent = ack("r1", None, error="GET /placement: TimeoutError")
    report = report_publication(second_view, plan, second, RouterView({"r0": ack("r0", 2), "r1": silent}, now=2.0))
    assert report.adapter_statuses["b"]["phase"] == "Ready"
    # No answering router vouches for it: it waits for the silent one, and says so.
    report = report_publication(second_view, plan, second, RouterView({"r0": ack("r0", 1), "r1": silent}, now=2.0))
    ready = next(c for c in report.adapter_statuses["b"]["conditions"] if c["type"] == "Ready")
    assert report.adapter_statuses["b"]["phase"] == "Loading" and ready["reason"] == "WaitingForRouters"
    assert "r1 (no answer)" in ready["message"] and "r0 (revision 1)" in ready["message"]
    report = report_publication(second_view, plan, second, RouterView({"r1": silent}, now=2.0))
    assert report.adapter_statuses["b"]["phase"] == "Loading"


def test_a_behind_router_holds_a_new_adapter_until_it_is_stale_then_only_degrades_the_pool():
    first_view = view(adapter("a"))
    plan, first = publish(first_view)
    memory = _two_routers_took(first_view, plan, first)
    second_view = view(adapter("a"), adapter("b"))
    plan, second = publish(second_view, memory, now=2.0)
    routers = {"r0": ack("r0", 2), "r1": ack("r1", 1, error="configmap ns/p-placement: HTTP 401 Unauthorized")}
    early = report_publication(second_view, plan, second, RouterView(routers, now=2.0))
    assert early.adapter_statuses["b"]["phase"] == "Loading"  # it answers: it may take it within a pass
    plan, third = publish(second_view, early.memory, now=13.0)
    late = report_publication(second_view, plan, third, RouterView(routers, now=13.0))
    assert late.adapter_statuses["b"]["phase"] == "Ready"
    assert conditions(late.pool_status)["Degraded"] == ("True", ROUTER_PLACEMENT_STALE)


def test_routers_that_are_gone_are_forgotten():
    assert remember_revisions({"r0": ack("r0", None)}, {"r0": 3, "r9": 4}) == {"r0": 3}
    assert remember_revisions({"r0": ack("r0", 5)}, {"r0": 3}) == {"r0": 5}
    assert remember_revisions({"r0": ack("r0", None)}, {}) == {}
