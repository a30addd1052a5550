"""The hostile-tenant benchmark at toy size on CPU: a live server, a refused class and a served one, and the
report's structure; the classes' requests follow the server's limits."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

from kubelora.bench.hostile import HostileConfig, main, run
from kubelora.bench.hostile_classes import CLASSES, Workload
from kubelora.bench.hostile_report import COLUMNS, render_markdown


def toy_workload(variant: int = 0) -> Workload:
    return Workload("base", [10, 11, 12, 13], 4, 512, Path("/a/plain"), Path("/a/pathological"), variant)


def test_classes_are_built_at_the_servers_limits():
    from kubelora.engine.server.app import MAX_BODY_BYTES
    from kubelora.engine.server.protocol import MAX_ALLOWED_TOKEN_IDS, MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOP_STRINGS

    stop = json.loads(CLASSES["stop-strings"](toy_workload()).hostile.body)
    assert stop["n"] == MAX_PROMPTS and len(stop["stop"]) == MAX_STOP_STRINGS
    assert {len(s) for s in stop["stop"]} == {MAX_STOP_CHARS}
    ids = json.loads(CLASSES["token-ids"](toy_workload()).hostile.body)
    assert len(ids["allowed_token_ids"]) == MAX_ALLOWED_TOKEN_IDS and not set(ids["allowed_token_ids"]) & set(
        ids["stop_token_ids"])  # stop ids are never sampled: the request keeps its token count
    for prompt_len in range(3):  # whatever the remainder of the room left by the rest of the body
        workload = replace(toy_workload(), prompt=[10] * prompt_len)
        arrays = CLASSES["empty-arrays"](workload).hostile.body
        assert MAX_BODY_BYTES - 3 < len(arrays) <= MAX_BODY_BYTES and json.loads(arrays)["pad"][0] == []
    zipped = CLASSES["gzip"](toy_workload())
    assert gzip.decompress(zipped.hostile.body) == zipped.plain.body
    assert zipped.hostile.headers["Content-Encoding"] == "gzip"
    schemas = [CLASSES["slow-regex"](toy_workload(i)).hostile.body for i in range(2)]
    assert schemas[0] != schemas[1]  # each repeat compiles its own grammar (the server caches them)


def test_toy_run_reports_each_class(tmp_path):
    config = HostileConfig(classes=("gzip", "tiny-temperature"), num_repeats=1, prompt_len=4, max_tokens=4,
                           server_timeout_s=120.0)
    report = run(config, tmp_path)
    refused, served = report.results
    assert refused.statuses == [415] and refused.is_refused
    assert served.statuses == [200] and not served.is_refused
    for result in report.results:
        assert result.health_s and result.num_health_errors == 0
        assert result.is_victim_equal  # the victim is greedy: beside anything it answers as alone
        assert result.victim_ratio > 0 and len(result.plain_victim_s) == len(result.hostile_victim_s) == 1
    text = render_markdown(report)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |" and len(table) == 3
    assert "| gzip-encoded body | refused 415 |" in text and "| temperature 1e-40 | 200 |" in text
    assert all("p99 < 100 ms" in line and "ratio <= 2x" in line for line in table[1:])


def test_unknown_class_is_refused_at_the_entry_point(capsys):
    assert main(["--classes", "gzip,nothing"]) == 2
    assert "nothing" in capsys.readouterr().out
