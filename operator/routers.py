"""Whether the pool's routers route on what the operator published. Pure: acks, revisions and `now` in.

An adapter is routable once every ready router pod has taken a placement revision that includes it (one listing
a holder for it: `ReconcileMemory.included`); until then its Ready condition waits (`WaitingForRouters`). A router
that did not answer this pass is judged by the last revision it acknowledged (`ReconcileMemory.router_revisions`):
what it routed then it still routes. A router that did not answer, or is stale, holds an adapter back only while
no answering, current router routes it either: one faulty router degrades the pool, not every adapter. A
router whose acknowledged revision lags the published one for more than `STALE_AFTER_S` (an unanswered one
counts as lagging), or that has not read its placement for that long, makes the pool `Degraded`
(`RouterPlacementStale`). Routers that are not ready are out of the pool Service's endpoints, so they do not hold
adapters back, but a stale one still degrades the pool.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kubelora.operator.observe import RouterAck
from kubelora.operator.status import Failure, rfc3339

STALE_AFTER_S = 10.0
ROUTER_PLACEMENT_STALE = "RouterPlacementStale"
WAITING_FOR_ROUTERS = "WaitingForRouters"
RECHECK_BEHIND_S = 1.0  # the next pass while a router is behind but not yet stale (Ready follows its ack)
RECHECK_STALE_S = 5.0  # while one is stale (Degraded clears soon after it catches up)
ACK_WAIT_S = 2.0  # how long a pass waits for a current router to take the revision it just published
BEHIND_ACK_WAIT_S = 0.5  # for a router behind in the last pass (it answers as soon as its read fails)


@dataclass(frozen=True)
class RouterView:
    acks: Mapping[str, RouterAck] = field(default_factory=dict)  # router pod -> what it answered
    now: float = 0.0  # time.time() of the pass


@dataclass(frozen=True)
class RouterJudgement:
    behind: dict[str, float]  # router pod -> since when it lags the published revision (the next memory)
    entries: list[dict]  # the pool status's `routers`
    degraded: Failure | None  # RouterPlacementStale, or None
    next_pass_s: float | None  # a pass sooner than the resync, while a router lags
    revisions: dict[str, int] = field(default_factory=dict)  # router pod -> the last revision it acknowledged
    stale: frozenset[str] = frozenset()  # router pods stale now


def is_behind(ack: RouterAck, revision: int) -> bool:
    return ack.revision is None or ack.revision < revision


def judge_routers(view: RouterView, revision: int, behind_before: Mapping[str, float],
                  revisions_before: Mapping[str, int] | None = None) -> RouterJudgement:
    """revisions_before: router pod -> the last revision it acknowledged (the memory); the judgement's
    `revisions` adds this pass's answers and drops routers that are gone."""
    behind = {pod: behind_before.get(pod, view.now) for pod, ack in view.acks.items() if is_behind(ack, revision)}
    entries, stale, described = [], set(), []
    for pod in sorted(view.acks):
        ack = view.acks[pod]
        lag_s = view.now - behind[pod] if pod in behind else 0.0
        is_stale = lag_s > STALE_AFTER_S or (ack.age_s is not None and ack.age_s > STALE_AFTER_S)
        entries.append(_entry(ack, behind.get(pod), is_stale))
        if is_stale:
            stale.add(pod)
            described.append(_describe(ack, behind.get(pod)))
    degraded = None
    if described:
        degraded = Failure(ROUTER_PLACEMENT_STALE, f"placement revision {revision} is published; "
                           + "; ".join(described)
                           + " (requests through it are retried on other replicas; see docs/router.md)")
    next_pass_s = None
    if behind or stale:
        next_pass_s = RECHECK_STALE_S if stale else RECHECK_BEHIND_S
    revisions = remember_revisions(view.acks, revisions_before or {})
    return RouterJudgement(behind, entries, degraded, next_pass_s, revisions, frozenset(stale))


def remember_revisions(acks: Mapping[str, RouterAck], before: Mapping[str, int]) -> dict[str, int]:
    """router pod -> the revision it answered now, else the last one it acknowledged (routers gone are dropped)."""
    revisions = {}
    for pod, ack in acks.items():
        known = ack.revision if ack.revision is not None else before.get(pod)
        if known is not None:
            revisions[pod] = known
    return revisions


def unrouted(name: str, included: Mapping[str, int], acks: Mapping[str, RouterAck],
             revisions: Mapping[str, int] | None = None, stale: Collection[str] = ()) -> Failure | None:
    """Why `name` is not routable through every ready router yet (None: it is, or the pool runs none).

    revisions: each router's last acknowledged revision, for those that did not answer this pass; stale: routers
    judged stale. A router that did not answer or is stale holds `name` back only while no answering router that
    is not stale routes it."""
    since, revisions = included.get(name), revisions or {}

    def routes(ack: RouterAck) -> bool:
        revision = ack.revision if ack.revision is not None else revisions.get(ack.pod)
        return since is not None and revision is not None and revision >= since

    def is_sound(ack: RouterAck) -> bool:
        return ack.revision is not None and ack.pod not in stale

    ready = [ack for _, ack in sorted(acks.items()) if ack.is_ready]
    is_vouched = any(is_sound(ack) and routes(ack) for ack in ready)
    lagging = [ack for ack in ready if not routes(ack) and (is_sound(ack) or not is_vouched)]
    if not lagging:
        return None
    where = ", ".join(f"{ack.pod} ({'no answer' if ack.revision is None else f'revision {ack.revision}'})"
                      for ack in lagging)
    wanted = f"placement revision {since}" if since is not None else "a placement listing a holder"
    return Failure(WAITING_FOR_ROUTERS, f"loaded, but not every ready router routes it yet: {where} have not "
                                        f"taken {wanted}")


def _entry(ack: RouterAck, behind_since: float | None, is_stale: bool) -> dict:
    entry: dict = {"name": ack.pod, "ip": ack.ip, "ready": ack.is_ready, "stale": is_stale}
    if ack.revision is not None:
        entry["revision"] = ack.revision
    if ack.loaded_at:
        entry["acknowledgedAt"] = rfc3339(ack.loaded_at)
    if behind_since is not None:
        entry["behindSince"] = rfc3339(behind_since)
    if is_stale:  # only then: a steady age would rewrite the status every pass
        if ack.age_s is not None:
            entry["placementAgeSeconds"] = int(ack.age_s)
        if ack.error:
            entry["lastError"] = ack.error
    return entry


def _describe(ack: RouterAck, behind_since: float | None) -> str:
    taken = "did not answer" if ack.revision is None else f"routes on revision {ack.revision}"
    parts = [f"router {ack.pod} {taken}"]
    if behind_since is not None:
        parts.append(f"behind since {rfc3339(behind_since)}")
    if ack.age_s is not None and ack.age_s > STALE_AFTER_S:
        parts.append(f"its placement reads fail for over {STALE_AFTER_S:g} s")
    if ack.error:
        parts.append(f"last error: {ack.error}")
    return ", ".join(parts)
