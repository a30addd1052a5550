"""The router-keys benchmark at toy size on CPU: live `kubelora router` processes in front of the fake engine, every
arm's samples and the report's structure (never its timings); the arms' placements and the routers' rotation."""

from __future__ import annotations

import json

import pytest

from kubelora.bench.router_keys import (ARMS, ROUTER_ARMS, VARIANTS, RouterKeysConfig, adapter_names, main,
                                        placement, roles, run)
from kubelora.bench.router_keys_report import COLUMNS, KEY_PATH_COLUMNS, render_markdown
from kubelora.contract.keys import key_digest
from kubelora.router.placement import parse_placement

pytestmark = pytest.mark.timeout(180)


def test_arms_placements_and_rotation():
    config = RouterKeysConfig(num_keys=10, num_granted=3)
    keys = [f"{i:064x}" for i in range(10)]
    for arm in ROUTER_ARMS:
        raw = {**placement(config, arm, keys), "revision": 1, "replicas": [{"pod": "engine-0", "url": "http://e",
                                                                             "ready": True}]}
        parsed = parse_placement(json.dumps(raw))
        assert len(parsed.adapters) == 30 and parsed.api_keys.required == arm.startswith("keys")
        if arm.startswith("keys"):
            grant = parsed.api_keys.grants[key_digest(keys[4])]
            assert grant.adapters == frozenset(adapter_names(4, 3))
            assert (grant.requests_per_minute is not None) == (arm == "keys+limits")
    turns = [roles(turn) for turn in range(len(ROUTER_ARMS))]
    for j in range(len(ROUTER_ARMS)):  # in a repeat every router plays every arm once
        assert sorted(t[j] for t in turns) == sorted(ROUTER_ARMS)


def test_toy_run_reports_every_arm(tmp_path):
    config = RouterKeysConfig(num_keys=20, num_granted=2, num_requests=5, concurrency=3, num_repeats=2,
                              num_warmup=2, num_key_path_calls=100)
    report = run(config, tmp_path)
    assert {(s.variant, s.arm, s.repeat) for s in report.samples} == {
        (v, a, r) for v in VARIANTS for a in ARMS for r in range(2)}
    for sample in report.samples:
        assert len(sample.latencies_s) == config.num_requests * len(ROUTER_ARMS)  # one block per router role
        assert all(t > 0 for t in sample.latencies_s)
        assert (sample.router_cpu_s is None) == (sample.arm == "engine")
        assert sample.router_cpu_s is None or sample.router_cpu_s > 0
    assert set(report.key_path_us) == {"open", "keys", "keys+limits"}
    text = render_markdown(report)
    tables = [line for line in text.splitlines() if line.startswith("| ")]
    assert tables[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(tables) == 1 + len(VARIANTS) * len(ARMS) + 1 + 2
    assert "| " + " | ".join(KEY_PATH_COLUMNS) + " |" in tables
    keyed = [line for line in tables if "| keys" in line and "CPU <= 1.02x" in line]
    assert len(keyed) == 2 * len(VARIANTS) and all("p99 +<= 1 ms" in line for line in keyed)
    assert "20 keys in the table" in text and "- cpu: " in text and "- aiohttp: " in text


def test_invalid_settings_are_refused_at_the_entry_point(capsys):
    assert main(["--requests", "0"]) == 2
    assert "num_requests" in capsys.readouterr().out
