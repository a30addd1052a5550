"""The placement simulator at a tiny size: structure and invariants, not its numbers."""

from __future__ import annotations

import pytest

from kubelora.bench.placement_fleet import Counts, ReplicaState, TierConfig
from kubelora.bench.placement_report import render_markdown, render_table, verdicts
from kubelora.bench.placement_sim import QUICK, main, run_all
from kubelora.bench.placement_traces import TraceConfig, generate
from kubelora.operator import placement


@pytest.fixture(scope="module")
def quick():
    trace = generate(TraceConfig(**QUICK))
    tiers = TierConfig(max_loras=2, max_cpu_loras=24)
    return trace, tiers, run_all(trace, tiers, 1.25)


def test_trace_is_seeded_and_ordered():
    a, b = generate(TraceConfig(**QUICK)), generate(TraceConfig(**QUICK))
    assert a.requests == b.requests and a.failures == b.failures
    assert generate(TraceConfig(**{**QUICK, "seed": 1})).requests != a.requests
    times = [r.at_s for r in a.requests]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < a.config.day_s
    assert {r.adapter for r in a.requests} <= set(a.adapters)


def test_policies_see_the_same_requests_and_route_every_one(quick):
    trace, _, results = quick
    assert [r.name for r in results] == ["ours", "least-loaded", "single-copy", "random (reference)"]
    assert {r.counts.num_requests for r in results} == {len(trace.requests)}


def test_counts_are_consistent(quick):
    trace, _, results = quick
    num_adapters_requested = len({r.adapter for r in trace.requests})
    for result in results:
        c = result.counts
        # a load is a miss, a preload or an adapter's first request (not a miss; ours may have preloaded it)
        assert 0 <= c.num_loads - c.num_misses - c.num_preloads <= num_adapters_requested
        if result.name != "ours":
            assert c.num_loads == c.num_misses + num_adapters_requested
        assert 0 <= result.miss_share <= 1
        assert result.mean_load > 0 and result.p99_over_mean >= 1.0
    assert {r.name: r.counts.num_preloads for r in results}["least-loaded"] == 0


def test_rendezvous_score_is_restored(quick):
    assert placement.rendezvous_score.__name__ == "rendezvous_score"
    assert not hasattr(placement.rendezvous_score, "cache_info")


def test_tiers_evict_least_recent_idle_adapters():
    replica, counts = ReplicaState(TierConfig(max_loras=1, max_cpu_loras=2)), Counts()
    replica.serve("a", counts, is_first=True)
    replica.serve("b", counts, is_first=True)
    replica.finish("b", 10)
    replica.serve("c", counts, is_first=True)  # "a" is busy: "b" goes
    assert list(replica.host) == ["a", "c"] and list(replica.device) == ["c"]
    replica.serve("b", counts, is_first=False)
    assert (counts.num_requests, counts.num_misses, counts.num_loads, counts.num_swaps) == (4, 1, 4, 4)
    assert replica.tokens_served == {"b": 10}


def test_report_renders(quick, tmp_path, capsys):
    trace, tiers, results = quick
    assert render_table(results).count("\n") == 5
    assert [v for _, v, _ in verdicts(results)] == [v for _, v, _ in verdicts(results) if v in ("met", "MISSED")]
    page = render_markdown(trace, tiers, 1.25, results, "method", "kubelora bench placement")
    assert "| ours |" in page and "## Method" in page
    out = tmp_path / "placement.md"
    assert main(["--quick", "--write", str(out)]) == 0
    assert "| least-loaded |" in capsys.readouterr().out and "| single-copy |" in out.read_text()


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        TierConfig(max_loras=8, max_cpu_loras=4)
    with pytest.raises(ValueError, match="hot_start"):
        TraceConfig(hot_start=0.9, hot_end=0.1)
