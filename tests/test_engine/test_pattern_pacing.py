"""The loading thread's share of the GIL while it compiles and matches an adapter's pattern keys: it rests
_REST_RATIO times as long as it works, in short stretches, across the compiles and every lookup of a load.

The pacer's bookkeeping is checked on a fake clock; a load of slow keys on the real one, loosely (the machine may
deschedule the test between calls)."""

from __future__ import annotations

import time

import pytest

from kubelora.engine.adapters import patterns
from kubelora.engine.adapters.peft_config import module_name

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FakeClock:
    """patterns.time with a clock the test moves; `sleep` records what was asked and moves the clock by it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.rests: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.rests.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(patterns, "time", fake)
    return fake


def test_the_pacer_rests_its_ratio_of_the_work_once_a_stretch_is_done(clock):
    pacer = patterns._Pacer()
    pacer.start()
    for _ in range(10):  # ten calls of 0.3 ms: rests after the 4th and the 8th (1.2 ms of work each)
        clock.now += 0.0003
        pacer.tick()
    assert clock.rests == pytest.approx([patterns._REST_RATIO * 0.0012] * 2)


def test_one_long_call_is_rested_in_proportion(clock):
    pacer = patterns._Pacer()
    pacer.start()
    clock.now += 0.005  # one compile of 5 ms
    pacer.tick()
    assert clock.rests == pytest.approx([patterns._REST_RATIO * 0.005])


def test_work_carries_over_between_runs_and_idle_time_does_not(clock):
    """Many lookups each under _WORK_S add up to a rest; the time between them is not work."""
    pacer = patterns._Pacer()
    for _ in range(5):
        pacer.start()
        clock.now += 0.0003
        pacer.tick()
        clock.now += 1.0  # idle between lookups
    assert clock.rests == pytest.approx([patterns._REST_RATIO * 0.0012])


class SlowKey:
    """A compiled key whose compile and each match take 0.4 ms of the fake clock, matching nothing."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        clock.now += 0.0004

    def match(self, name: bytes) -> None:
        self._clock.now += 0.0004


def test_a_maps_lookups_go_on_from_the_work_of_its_compiles(clock, monkeypatch):
    monkeypatch.setattr(patterns, "_compile", lambda adapter, field, key: SlowKey(clock))
    compiled = patterns.compile_patterns("a", "alpha_pattern", {"k0": 2.0, "k1": 3.0}, is_rank=False)
    assert clock.rests == []  # 0.8 ms of compiles
    assert compiled.lookup(module_name(0, "q_proj"), 1.0) == 1.0  # 0.4 ms more: a stretch of 1.2 ms
    assert clock.rests == pytest.approx([patterns._REST_RATIO * 0.0012])


def test_a_load_of_slow_keys_rests_at_the_ratio(monkeypatch):
    """MAX_PATTERN_KEYS slow keys compiled and every module name of four layers looked up: tens of ms of work
    in many stretches, rested for at about the ratio (at least half of it here, where gaps between the test's
    calls count as work but are not rested for). How long one stretch lasts is the fake clock's to check: on a
    busy machine a stretch of 1 ms of work may last ten times that."""
    asked: list[float] = []
    monkeypatch.setattr(patterns.time, "sleep", asked.append)
    keys = {f"(.|.){{0,24}}!{i}": 1.0 for i in range(patterns.MAX_PATTERN_KEYS)}
    started = time.perf_counter()
    compiled = patterns.compile_patterns("a", "alpha_pattern", keys, is_rank=False)
    for layer in range(4):
        for module in MODULES:
            assert compiled.lookup(module_name(layer, module), 8.0) == 8.0
    worked_s = time.perf_counter() - started
    assert len(asked) >= 10 and sum(asked) >= 0.5 * patterns._REST_RATIO * worked_s, (sum(asked), worked_s)
