"""routing.route: base model, held adapter, unheld adapter (home), unknown model, no placement, no ready replica."""

from __future__ import annotations

import json

import pytest

from kubelora.router import routing
from kubelora.router.hashring import HashRing
from kubelora.router.placement import parse_placement


def placement(ready=("p0", "p1", "p2"), not_ready=(), adapters=None):
    replicas = [{"pod": pod, "url": f"http://10.0.0.{i}:8000", "ready": pod in ready}
                for i, pod in enumerate([*ready, *not_ready])]
    return parse_placement(json.dumps({"pool": "p", "baseModel": "base", "revision": 3, "replicas": replicas,
                                       "adapters": adapters if adapters is not None else {}}))


def pods(route: routing.Route) -> list[str]:
    return [r.pod for r in route.candidates]


def test_base_model_goes_to_the_least_loaded_ready_replica():
    route = routing.route(placement(not_ready=("p3",)), "base", {"p0": 2, "p1": 0, "p2": 1, "p3": 0}, 1.25)
    assert route.decision is routing.Decision.BASE
    assert pods(route) == ["p1", "p2", "p0"]


def test_idle_replicas_take_base_requests_in_turn():
    firsts = {pods(routing.route(placement(), "base", {}, 1.25, tiebreak=i))[0] for i in range(3)}
    assert firsts == {"p0", "p1", "p2"}


def test_held_adapter_goes_to_a_ready_holder_first_then_the_others():
    p = placement(not_ready=("p3",), adapters={"a": ["p1", "p2", "p3"]})
    route = routing.route(p, "a", {}, 1.25)
    assert route.decision is routing.Decision.HOLDER
    assert pods(route)[:2] == HashRing(["p1", "p2"]).walk("a")  # p3 holds it but is not ready
    assert pods(route)[2:] == ["p0"]


def test_held_adapter_spills_to_the_other_holder_under_load():
    p = placement(adapters={"a": ["p1", "p2"]})
    home, other = HashRing(["p1", "p2"]).walk("a")
    assert pods(routing.route(p, "a", {home: 5}, 1.25))[0] == other


def test_adapter_held_by_no_ready_replica_goes_to_its_home():
    p = placement(not_ready=("p3",), adapters={"a": [], "b": ["p3"]})
    for name in ("a", "b"):
        route = routing.route(p, name, {}, 1.25)
        assert route.decision is routing.Decision.HOME
        assert pods(route) == HashRing(["p0", "p1", "p2"]).walk(name)


def test_unknown_model_is_refused_even_without_ready_replicas():
    with pytest.raises(routing.UnknownModel) as info:
        routing.route(placement(ready=(), not_ready=("p0",)), "nope", {}, 1.25)
    assert info.value.model == "nope"


def test_no_placement_and_no_ready_replica():
    with pytest.raises(routing.PlacementNotLoaded):
        routing.route(None, "base", {}, 1.25)
    with pytest.raises(routing.PlacementNotLoaded):  # empty: no replicas, so no 404 from a list that may lag
        routing.route(placement(ready=()), "tenant-new", {}, 1.25)
    with pytest.raises(routing.NoReadyReplica):
        routing.route(placement(ready=(), not_ready=("p0",), adapters={"a": ["p0"]}), "a", {}, 1.25)
