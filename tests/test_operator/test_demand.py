"""Copies that follow demand (replicas "auto"): measured from the engines' token counters, in proportion to each
adapter's share, within minReplicas/maxReplicas, rising at once and falling only after the scale-down window, and
no more new copies per pass than the churn cap allows."""

from __future__ import annotations

import dataclasses

import pytest

from kubelora.operator.decide import plan_pass
from kubelora.operator.demand import (CHURN_CAP, DEMAND, MAX_REPLICAS, MIN_REPLICAS, SCALE_DOWN_WINDOW,
                                      SCALE_DOWN_WINDOW_S, SPREAD, Bounds, DemandMemory, measure, size)
from kubelora.operator.memory import ReconcileMemory
from kubelora.operator.specs import AdapterSpec, InvalidSpec

from .conftest import adapter, card, view


def steady(rates: dict[str, float]) -> DemandMemory:
    return DemandMemory(rates=rates, measured_at=0.0)


def test_rates_come_from_counter_differences_summed_over_pods_and_smoothed():
    memory = measure(DemandMemory(), {("e0", "a"): 100, ("e1", "a"): 50}, now=0.0)
    assert memory.rates == {}  # one reading is no rate yet
    for step in range(1, 60):  # 30 tokens/s on e0 and 10 on e1, for ten minutes
        memory = measure(memory, {("e0", "a"): 100 + 300 * step, ("e1", "a"): 50 + 100 * step}, now=10.0 * step)
    assert memory.rates["a"] == pytest.approx(40.0, rel=1e-3)
    restarted = measure(memory, {("e0", "a"): 120, ("e1", "a"): 50 + 100 * 60}, now=600.0)  # e0's engine restarted
    one_step = 1 - 2.718281828 ** (-10 / 60)
    assert restarted.rates["a"] == pytest.approx(40.0 + one_step * ((120 + 100) / 10 - 40.0), rel=1e-3)
    assert measure(restarted, {}, now=600.1) is restarted  # too soon to tell anything


def test_copies_follow_each_adapters_share_within_its_bounds():
    """ceil(pods x share x SPREAD): SPREAD 8 puts an adapter with 1/8 of the demand on every pod."""
    assert SPREAD == 8
    memory = steady({"hot": 50.0, "warm": 2.0, "cold": 0.1, "idle": 0.0, "capped": 47.9})
    bounds = {"hot": Bounds(), "warm": Bounds(), "cold": Bounds(), "idle": Bounds(min_replicas=2),
              "capped": Bounds(max_replicas=1)}
    sizings, _ = size(memory, bounds, num_pods=16, total_rate=None, now=0.0)
    assert {a: (s.copies, s.reason) for a, s in sizings.items()} == {
        "hot": (16, DEMAND), "warm": (3, DEMAND), "cold": (1, DEMAND), "idle": (2, MIN_REPLICAS),
        "capped": (1, MAX_REPLICAS)}  # warm: ceil(16 x 0.02 x 8) = 3; cold: ceil(0.128) = 1
    sizings, _ = size(steady({"only": 5.0}), {"only": Bounds()}, num_pods=3, total_rate=None, now=0.0)
    assert sizings["only"].copies == 3  # all the demand: every pod, never more


def test_a_rise_is_taken_at_once_and_a_fall_after_the_scale_down_window():
    bounds = {"a": Bounds(), "b": Bounds()}
    memory = steady({"a": 1.0, "b": 99.0})
    sizings, memory = size(memory, bounds, 64, None, now=0.0)
    assert sizings["a"].copies == 6  # ceil(64 x 0.01 x 8)
    memory = dataclasses.replace(memory, rates={"a": 4.0, "b": 396.0 / 4 - 3.0})
    sizings, memory = size(memory, bounds, 64, None, now=60.0)
    assert sizings["a"].copies > 6 and sizings["b"].copies == 64
    rise = sizings["a"].copies
    memory = dataclasses.replace(memory, rates={"a": 1.0, "b": 99.0})
    sizings, memory = size(memory, bounds, 64, None, now=120.0)
    assert (sizings["a"].copies, sizings["a"].reason) == (rise, SCALE_DOWN_WINDOW)  # the fall waits
    sizings, memory = size(memory, bounds, 64, None, now=60.0 + SCALE_DOWN_WINDOW_S - 1)
    assert sizings["a"].copies == rise
    sizings, memory = size(memory, bounds, 64, None, now=60.0 + SCALE_DOWN_WINDOW_S + 1)
    assert (sizings["a"].copies, sizings["a"].reason) == (6, DEMAND)
    assert all(len(window) <= 2 for window in memory.recommendations.values())  # only maxima are kept


def test_new_copies_per_pass_are_capped_hottest_first():
    bounds = {"a": Bounds(), "b": Bounds()}
    _, memory = size(steady({"a": 1.0, "b": 1.0}), bounds, 16, None, now=0.0)  # every pod each
    memory = dataclasses.replace(memory, rates={"a": 3.0, "b": 1.0}, copies={"a": 2, "b": 2})
    sizings, memory = size(memory, bounds, 16, None, now=5.0)  # 5 s: 6 loads/pod/min x 16 pods -> 8 new copies
    assert (sizings["a"].copies, sizings["a"].reason) == (10, CHURN_CAP)
    assert sizings["b"].copies == 2  # nothing left for the colder one this pass
    sizings, _ = size(memory, bounds, 16, None, now=65.0)
    assert sizings["a"].copies == 16 and sizings["b"].copies >= 4


def test_replicas_auto_parses_with_its_bounds():
    spec = AdapterSpec.from_body(adapter("a", replicas="auto", minReplicas=2, maxReplicas=5))
    assert spec.auto == Bounds(2, 5)
    assert AdapterSpec.from_body(adapter("a", replicas="auto")).auto == Bounds(1, None)
    assert AdapterSpec.from_body(adapter("a", replicas=3)).auto is None
    with pytest.raises(InvalidSpec, match="maxReplicas"):
        AdapterSpec.from_body(adapter("a", replicas="auto", minReplicas=3, maxReplicas=2))


def test_a_pass_places_auto_adapters_by_the_demand_the_pods_report():
    def held(tokens_hot: int, tokens_cold: int) -> dict:
        cards = {"hot": dataclasses.replace(card("hot", "/adapters/hot"), tokens_served=tokens_hot),
                 "cold": dataclasses.replace(card("cold", "/adapters/cold"), tokens_served=tokens_cold)}
        return {pod: dict(cards) for pod in ("e0", "e1", "e2", "e3")}

    bodies = (adapter("hot", replicas="auto"), adapter("cold", replicas="auto"), adapter("fixed", replicas=1))
    plan, memory = plan_pass(view(*bodies, held=held(0, 0)), ReconcileMemory(), now=0.0)
    assert {a: len(plan.placement.pods_of(a)) for a in ("hot", "cold", "fixed")} == {"hot": 1, "cold": 1,
                                                                                       "fixed": 1}
    assert plan.sizings["hot"].reason == MIN_REPLICAS
    for step in range(1, 40):  # each pod serves hot 100 tokens/s, cold 1
        plan, memory = plan_pass(view(*bodies, held=held(1000 * step, 10 * step)), memory, now=10.0 * step)
    assert len(plan.placement.pods_of("hot")) == 4 and len(plan.placement.pods_of("cold")) == 1
    assert plan.sizings["hot"].reason == DEMAND  # ceil(4 pods x 99% of the demand x SPREAD): every pod


def test_an_evicted_placed_copy_is_made_resident_again_at_most_once_a_minute():
    """A host tier too small for what is placed plus what is asked on demand evicts the placed copy again and
    again: the repair preload is paced instead of traded for an eviction every pass."""
    from kubelora.operator.decide import REPRELOAD_S

    evicted = {"e0": {"a": card("a", "/adapters/a", "known")}}
    repairs = []
    memory = ReconcileMemory()
    for now in (0.0, 2.0, 30.0, REPRELOAD_S + 1):
        plan, memory = plan_pass(view(adapter("a", replicas=1), held=evicted), memory, now=now)
        repairs += [now for action in plan.actions if getattr(action, "is_residency_repair", False)]
    assert repairs == [0.0, REPRELOAD_S + 1]
