"""`kubelora bench serve`: the workload's statistics (pure), and the benchmark end to end on the CPU at the smoke
preset against a tiny model (the H200 run is its own command; here every code path runs and the rows are sane)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kubelora.bench.serve_client import RequestRecord
from kubelora.bench.serve_report import NOT_REPORTED, RateRow, Slo, hit_rate_of, merge_rows, rate_row
from kubelora.bench.serve_workload import (LMSYS_ANSWER_TOKENS, LMSYS_PROMPT_TOKENS, SLORA_LENGTHS, TextMaker,
                                           WorkloadConfig, WorkloadKind, build_conversations, turn_messages,
                                           zipf_weights)

BIG = 10**6  # caps out of the way: the lengths' means are the cited ones


def test_adapters_follow_zipf_and_arrivals_their_rate():
    config = WorkloadConfig(num_adapters=100, max_prompt_tokens=BIG, max_answer_tokens=BIG)
    rate, duration = 400.0, 50.0
    conversations = build_conversations(config, rate, duration, seed=0)
    # Conversations start at rate / mean turns (4), as a Poisson process: exponential gaps of that mean.
    assert len(conversations) == pytest.approx(rate / 4 * duration, rel=0.05)
    gaps = np.diff([c.start_s for c in conversations])
    assert gaps.mean() == pytest.approx(4 / rate, rel=0.05) and gaps.std() == pytest.approx(4 / rate, rel=0.1)
    counts = np.bincount([c.adapter for c in conversations], minlength=100)
    expected = zipf_weights(100, 1.0)
    assert counts[0] / len(conversations) == pytest.approx(expected[0], rel=0.1)  # 1 / H(100), about 0.19
    assert counts[0] / counts[1] == pytest.approx(2.0, rel=0.2) and counts[0] / counts[9] == pytest.approx(10, rel=0.35)
    assert counts[:10].sum() > counts[10:].sum()  # the head carries more than the long tail
    turns = [c.num_turns for c in conversations]
    assert set(turns) == {3, 4, 5} and np.mean(turns) == pytest.approx(4, rel=0.05)
    users = np.concatenate([c.user_tokens for c in conversations])
    answers = np.concatenate([c.answer_tokens for c in conversations])
    assert users.mean() == pytest.approx(LMSYS_PROMPT_TOKENS, rel=0.05)
    assert answers.mean() == pytest.approx(LMSYS_ANSWER_TOKENS, rel=0.05)
    # A tenant's system prompt length is fixed, within the configured range.
    by_tenant = {}
    for c in conversations:
        assert by_tenant.setdefault(c.adapter, c.system_tokens) == c.system_tokens and 1000 <= c.system_tokens <= 2000


def test_other_workloads_are_single_turn():
    uniform = build_conversations(WorkloadConfig(kind=WorkloadKind.UNIFORM, num_adapters=5), 200, 10, seed=1)
    lengths = np.array([(c.user_tokens[0], c.answer_tokens[0]) for c in uniform])
    assert all(c.num_turns == 1 and c.system_tokens == 0 for c in uniform)
    assert lengths.min() >= SLORA_LENGTHS[0] and lengths.max() <= SLORA_LENGTHS[1]
    assert len(uniform) == pytest.approx(2000, rel=0.1)  # one request per conversation: the full rate
    no_prefix = build_conversations(WorkloadConfig(kind=WorkloadKind.NO_PREFIX, num_adapters=5), 50, 10, seed=1)
    assert all(c.num_turns == 1 and c.system_tokens == 0 and c.user_tokens[0] > 1000 for c in no_prefix)
    text = TextMaker(1.3)
    starts = {text.user_message(c, 0)[:24] for c in no_prefix}
    assert len(starts) == len(no_prefix)  # no two prompts share their start


def test_turns_carry_the_history():
    config = WorkloadConfig(num_adapters=3, system_tokens=(40, 60))
    [first, *others] = build_conversations(config, 50, 5, seed=2)
    text = TextMaker(1.5)
    system = text.system_prompt(config, first.adapter, first.system_tokens)
    # The tenant's system prompt is one text for all its conversations, and another tenant's differs.
    assert all(text.system_prompt(config, c.adapter, c.system_tokens) == system for c in others
               if c.adapter == first.adapter)
    assert text.system_prompt(config, first.adapter + 1, first.system_tokens) != system
    users, answers, previous = [], [], None
    for turn in range(first.num_turns):
        users.append(text.user_message(first, turn))
        messages = turn_messages(system, users, answers)
        assert len(messages) == 2 + 2 * turn and messages[0] == {"role": "system", "content": system}
        if previous is not None:  # this turn's prompt is the last one, its answer, and the new message
            assert messages[:len(previous)] == previous
            assert messages[len(previous)] == {"role": "assistant", "content": answers[-1]}
        previous = messages
        answers.append(f"answer {turn}")
    assert len(set(users)) == len(users)
    # About the number of tokens asked for, at the tokens per word given.
    assert len(text.text(300, 0).split()) == 200


def _record(ttft: float, end: float, tokens: int = 5, cached: int | None = None, error: str | None = None):
    return RequestRecord(conversation=0, turn=0, adapter="a", sent_s=0.0, ttft_s=ttft, end_s=end, prompt_tokens=100,
                         completion_tokens=tokens, cached_tokens=cached, error=error)


def test_rows_goodput_and_hit_rate_sources():
    slo = Slo(ttft_p99_s=1.0, tpot_p99_s=0.06)
    fast = [_record(0.1, 0.1 + 4 * 0.05, cached=50) for _ in range(10)]
    row = rate_row("r", "sweep", "chat", 3, "on", 1.0, fast, slo, None)
    assert row.meets_slo and row.goodput == row.requests_per_s == pytest.approx(10 / 0.3)
    assert row.tpot_p99_s == pytest.approx(0.05) and row.hit_rate == 0.5 and row.hit_rate_source == "usage"
    slow = fast + [_record(2.0, 2.5)]
    row = rate_row("r", "sweep", "chat", 3, "on", 1.0, slow, slo, {"queries": 1000.0, "hits": 250.0})
    assert not row.meets_slo and row.goodput == 0 and row.slo_attainment == pytest.approx(10 / 11)
    assert (row.hit_rate, row.hit_rate_source) == (0.25, "metrics")  # one response without cached tokens
    assert hit_rate_of(slow, None) == (None, NOT_REPORTED)
    failed = rate_row("r", "sweep", "chat", 3, "on", 1.0, fast + [_record(None, 1.0, 0, error="boom")], slo, None)
    assert not failed.meets_slo and failed.num_errors == 1 and failed.first_error == "boom"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from kubelora.cli.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bench-serve") / "model")


def _rows(path: Path) -> list[RateRow]:
    return [RateRow(**raw) for raw in json.loads(path.read_text())["rows"]]


def _assert_sane(row: RateRow) -> None:
    assert row.num_requests > 0 and row.num_errors == 0, row
    assert row.requests_per_s > 0 and row.output_tokens_per_s > 0 and row.prompt_tokens_per_s > 0
    assert 0 < row.ttft_p50_s <= row.ttft_p99_s < row.seconds
    assert 0 < row.tpot_p50_s <= row.tpot_p99_s
    assert 0 <= row.slo_attainment <= 1 and row.goodput in (0.0, row.requests_per_s)
    if row.hit_rate_source == NOT_REPORTED:
        assert row.hit_rate is None
    else:
        assert 0 <= row.hit_rate <= 1
        if row.cache == "off":
            assert row.hit_rate == 0


def test_bench_serve_sweep_runs_on_cpu(tiny_model: Path, tmp_path: Path):
    from kubelora.bench import serve

    rows_path, report = tmp_path / "rows.json", tmp_path / "report.md"
    argv = ["--preset", "smoke", "--model-dir", str(tiny_model), "--workdir", str(tmp_path / "work"),
            "--rows", str(rows_path), "--write", str(report)]
    assert serve.main(argv) == 0
    rows = _rows(rows_path)
    caches = {row.cache for row in rows}
    assert caches in ({"on", "off"}, {"default"})  # "default": a server without the cache switch
    assert len(rows) == 2 * len(caches) and {row.rate for row in rows} == {4.0, 8.0}
    for row in rows:
        _assert_sane(row)
        assert row.mode == "sweep" and row.workload == "chat" and row.num_adapters == 3
        if row.cache == "on" and row.hit_rate is not None:  # later turns repeat the system prompt and history
            assert row.hit_rate > 0
    text = report.read_text()
    assert all(f"| {row.run} | {row.rate:g} |" in text for row in rows) and "Max goodput per run" in text


def test_bench_serve_retention_runs_on_cpu_and_rows_merge(tiny_model: Path, tmp_path: Path):
    from kubelora.bench import serve

    rows_path, report = tmp_path / "rows.json", tmp_path / "report.md"
    earlier = rate_row("sweep chat 3 adapters, cache on", "sweep", "chat", 3, "on", 4.0,
                       [_record(0.1, 0.3)], Slo(), None)
    merge_rows(rows_path, [earlier])  # a row of an earlier command
    argv = ["--preset", "smoke", "--model-dir", str(tiny_model), "--workdir", str(tmp_path / "work"),
            "--rows", str(rows_path), "--write", str(report), "--mode", "retention", "--retention-counts", "2",
            "--rates", "8", "--duration", "1"]
    assert serve.main(argv) == 0
    rows = [row for row in _rows(rows_path) if row.mode == "retention"]
    assert [(row.num_adapters, row.workload) for row in rows] == [(2, "uniform")]
    assert {row.cache for row in rows} <= {"off", "default"}
    for row in rows:
        _assert_sane(row)
    assert earlier in _rows(rows_path)  # kept beside the new rows, and reported with them
    text = report.read_text()
    assert f"| {earlier.run} |" in text and "Retention (max goodput by registered adapters)" in text


def test_bench_serve_no_prefix_workload_runs_on_cpu(tiny_model: Path, tmp_path: Path):
    from kubelora.bench import serve

    rows_path = tmp_path / "rows.json"
    argv = ["--preset", "smoke", "--model-dir", str(tiny_model), "--workdir", str(tmp_path / "work"),
            "--rows", str(rows_path), "--workload", "no-prefix", "--cache", "on", "--rates", "8", "--duration", "1"]
    assert serve.main(argv) == 0
    [row] = _rows(rows_path)
    assert row.workload == "no-prefix" and row.cache in ("on", "default")
    _assert_sane(row)


def _row(run: str, mode: str, workload: str, count: int, cache: str, rate: float, ttft: float, meets: bool,
         out_tokens: float = 100.0) -> RateRow:
    row = rate_row(run, mode, workload, count, cache, rate, [_record(ttft, ttft + 0.2)], Slo(), None)
    return replace(row, meets_slo=meets, goodput=rate if meets else 0.0, output_tokens_per_s=out_tokens)


def test_targets_say_met_or_missed_by_how_much():
    from kubelora.bench.serve_targets import target_lines

    rows = [_row("off", "sweep", "chat", 10, "off", 1, 0.5, True),
            _row("off", "sweep", "chat", 10, "off", 2, 0.9, False),
            _row("on", "sweep", "chat", 10, "on", 1, 0.1, True), _row("on", "sweep", "chat", 10, "on", 2, 0.2, True),
            _row("np-on", "sweep", "no-prefix", 10, "on", 4, 0.1, True, out_tokens=97.0),
            _row("np-off", "sweep", "no-prefix", 10, "off", 4, 0.1, True, out_tokens=100.0),
            _row("r5", "retention", "uniform", 5, "off", 4, 0.1, True),
            _row("r2000", "retention", "uniform", 2000, "off", 4, 0.1, False),
            _row("r2000", "retention", "uniform", 2000, "off", 2, 0.1, True)]
    text = "\n".join(target_lines(rows))
    assert "TTFT p50 at 1 req/s" in text and "0.20x with the cache, target <= 0.3x: met" in text
    assert "max goodput with/without the cache: 2.00x, target >= 2x: met" in text
    assert "lost to the cache: 3.0%, target <= 2%: MISSED by 0.01" in text
    assert "retention, max goodput at 2000 / 5 adapters (cache off): 0.500x, target >= 0.95x: MISSED by 0.45" in text
    assert target_lines([]) == ["- retention, max goodput at 2000 / 5 adapters >= 0.95x: not measured"]
