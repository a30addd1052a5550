"""The real-traffic benchmark's targets, judged from its rows (whichever commands wrote them); each says met, or
missed and by how much. A target whose rows are missing is said to be not measured."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the report imports this module
    from kubelora.bench.serve_report import RateRow

MAX_TTFT_RATIO = 0.3  # TTFT p50 with the cache / without, at the highest rate the cache-off run meets the SLO
MIN_GOODPUT_RATIO = 2.0  # max goodput with the cache / without
MAX_NO_PREFIX_COST = 0.02  # 1 - peak output tokens/s with the cache / without, on the no-prefix workload
MIN_RETENTION = 0.95  # max goodput at the most registered adapters / at the fewest (S-LoRA: 0.945 at 2,000 / 5)
RETENTION_COUNTS = (5, 2000)  # the counts the retention target names


def _by_run(rows: list[RateRow], mode: str, workload: str) -> dict[tuple[int, str], list[RateRow]]:
    """(registered adapters, cache) -> its rows by rate."""
    runs: dict[tuple[int, str], list[RateRow]] = defaultdict(list)
    for row in rows:
        if row.mode == mode and row.workload == workload:
            runs[(row.num_adapters, row.cache)].append(row)
    return {key: sorted(value, key=lambda r: r.rate) for key, value in runs.items()}


def _judge(value: float, bound: float, is_upper: bool) -> str:
    is_met = value <= bound if is_upper else value >= bound
    return "met" if is_met else f"MISSED by {abs(value - bound):.3g}"


def _pairs(rows: list[RateRow], workload: str) -> list[tuple[int, list[RateRow], list[RateRow]]]:
    """(registered adapters, cache-on rows, cache-off rows) of the sweeps that ran both."""
    runs = _by_run(rows, "sweep", workload)
    counts = sorted({count for count, cache in runs if (count, "on") in runs and (count, "off") in runs})
    return [(count, runs[(count, "on")], runs[(count, "off")]) for count in counts]


def chat_lines(rows: list[RateRow]) -> list[str]:
    lines = []
    for count, on, off in _pairs(rows, "chat"):
        met = [r for r in off if r.meets_slo]
        at = {r.rate: r for r in on}.get(met[-1].rate) if met else None
        if at is None or not at.ttft_p50_s or not met[-1].ttft_p50_s:
            lines.append(f"- chat, {count} adapters, TTFT p50 with/without the cache <= {MAX_TTFT_RATIO:g}x: not "
                         "measured (no rate where the cache-off run meets the SLO and both runs have a TTFT)")
        else:
            ratio = at.ttft_p50_s / met[-1].ttft_p50_s
            lines.append(f"- chat, {count} adapters, TTFT p50 at {at.rate:g} req/s (the highest rate the cache-off "
                         f"run meets the SLO): {ratio:.2f}x with the cache, target <= {MAX_TTFT_RATIO:g}x: "
                         f"{_judge(ratio, MAX_TTFT_RATIO, True)}")
        best_on, best_off = max(r.goodput for r in on), max(r.goodput for r in off)
        if best_off > 0:
            ratio = best_on / best_off
            verdict = f"{ratio:.2f}x, target >= {MIN_GOODPUT_RATIO:g}x: {_judge(ratio, MIN_GOODPUT_RATIO, False)}"
        else:
            verdict = f"not measured: the cache-off run met the SLO at no rate (with the cache {best_on:.2f} req/s)"
        lines.append(f"- chat, {count} adapters, max goodput with/without the cache: {verdict}")
    return lines


def no_prefix_lines(rows: list[RateRow]) -> list[str]:
    lines = []
    for count, on, off in _pairs(rows, "no-prefix"):
        peak_on, peak_off = max(r.output_tokens_per_s for r in on), max(r.output_tokens_per_s for r in off)
        cost = 1 - peak_on / peak_off if peak_off else float("nan")
        lines.append(f"- no-prefix, {count} adapters, peak output tokens/s lost to the cache: {cost:.1%}, target <= "
                     f"{MAX_NO_PREFIX_COST:.0%}: {_judge(cost, MAX_NO_PREFIX_COST, True)}")
    return lines


def retention_target_lines(rows: list[RateRow]) -> list[str]:
    best = {count: max(r.goodput for r in run) for (count, cache), run in _by_run(rows, "retention", "uniform").items()
            if cache == "off"}
    fewest, most = RETENTION_COUNTS
    if fewest not in best or most not in best:
        return [f"- retention, max goodput at {most} / {fewest} adapters >= {MIN_RETENTION:g}x: not measured"]
    if not best[fewest]:
        return [f"- retention: not measured (no rate met the SLO with {fewest} adapters)"]
    ratio = best[most] / best[fewest]
    return [f"- retention, max goodput at {most} / {fewest} adapters (cache off): {ratio:.3f}x, target >= "
            f"{MIN_RETENTION:g}x: {_judge(ratio, MIN_RETENTION, False)}"]


def target_lines(rows: list[RateRow]) -> list[str]:
    return chat_lines(rows) + no_prefix_lines(rows) + retention_target_lines(rows)
