"""`kubelora bench serve`'s rows (one per run and rate), their merge across commands, and the markdown report."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kubelora.bench.serve_client import RequestRecord
from kubelora.bench.serve_targets import target_lines

NOT_REPORTED = "not reported"


@dataclass(frozen=True)
class Slo:
    ttft_p99_s: float = 1.0
    tpot_p99_s: float = 0.060

    def __post_init__(self) -> None:
        if self.ttft_p99_s <= 0 or self.tpot_p99_s <= 0:
            raise ValueError(f"SLO bounds must be > 0 seconds, got TTFT {self.ttft_p99_s}, TPOT {self.tpot_p99_s}")


@dataclass(frozen=True)
class RateRow:
    """One rate of one run. `run` names the run: mode, workload, registered adapters, cache on or off."""
    run: str
    mode: str
    workload: str
    num_adapters: int
    cache: str  # "on", "off", or "default" (a server without the switch)
    rate: float  # offered requests per second
    num_requests: int
    num_errors: int
    seconds: float  # the rate's start (its first scheduled arrival's clock zero) to its last answer's end
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    slo_attainment: float  # share of requests within both bounds on their own
    meets_slo: bool  # the run's TTFT p99 and TPOT p99 within the SLO, and no request failed
    goodput: float  # requests_per_s when meets_slo, else 0
    hit_rate: float | None  # cached prompt tokens / prompt tokens; None: not reported
    hit_rate_source: str  # "usage", "metrics" or NOT_REPORTED
    first_error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.run} @ {self.rate:g}"


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def rate_row(run: str, mode: str, workload: str, num_adapters: int, cache: str, rate: float,
             records: list[RequestRecord], slo: Slo, metric_delta: dict[str, float] | None) -> RateRow:
    """The row of one rate from its requests, and from the server's prefix cache counters' change over the rate
    (`metric_delta`, None when the server exports none) where no response reported cached tokens."""
    done = [r for r in records if r.error is None]
    seconds = max((r.end_s for r in records), default=0.0)  # the arrivals' clock starts at 0
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    within = [r for r in done if r.ttft_s is not None and r.ttft_s <= slo.ttft_p99_s
              and (r.tpot_s is None or r.tpot_s <= slo.tpot_p99_s)]
    ttft_p99, tpot_p99 = _percentile(ttfts, 99), _percentile(tpots, 99)
    errors = [r.error for r in records if r.error is not None]
    meets = bool(done) and not errors and ttft_p99 is not None and ttft_p99 <= slo.ttft_p99_s and (
        tpot_p99 is None or tpot_p99 <= slo.tpot_p99_s)
    per_s = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
    hit_rate, source = hit_rate_of(done, metric_delta)
    return RateRow(run=run, mode=mode, workload=workload, num_adapters=num_adapters, cache=cache, rate=rate,
                   num_requests=len(records), num_errors=len(errors), seconds=seconds,
                   requests_per_s=per_s(len(done)), output_tokens_per_s=per_s(sum(r.completion_tokens for r in done)),
                   prompt_tokens_per_s=per_s(sum(r.prompt_tokens for r in done)),
                   ttft_p50_s=_percentile(ttfts, 50), ttft_p99_s=ttft_p99, tpot_p50_s=_percentile(tpots, 50),
                   tpot_p99_s=tpot_p99, slo_attainment=len(within) / len(records) if records else 0.0,
                   meets_slo=meets, goodput=per_s(len(done)) if meets else 0.0, hit_rate=hit_rate,
                   hit_rate_source=source, first_error=errors[0] if errors else None)


def hit_rate_of(done: list[RequestRecord], metric_delta: dict[str, float] | None) -> tuple[float | None, str]:
    """Cached prompt tokens over prompt tokens: from the responses' usage when every one reported it, else from
    the server's counters, else not reported."""
    prompt = sum(r.prompt_tokens for r in done)
    if done and all(r.cached_tokens is not None for r in done) and prompt:
        return sum(r.cached_tokens for r in done) / prompt, "usage"
    if metric_delta is not None and metric_delta.get("queries", 0) > 0:
        return metric_delta["hits"] / metric_delta["queries"], "metrics"
    return None, NOT_REPORTED


# ---- rows across commands ----

def merge_rows(path: Path | None, rows: list[RateRow]) -> list[RateRow]:
    """The rows already in `path` (earlier commands of the same benchmark) with these added, a row of the same run
    and rate replaced; written back when a path is given."""
    kept: dict[str, RateRow] = {}
    if path is not None and path.exists():
        for raw in json.loads(path.read_text())["rows"]:
            row = RateRow(**raw)
            kept[row.key] = row
    for row in rows:
        kept[row.key] = row
    merged = sorted(kept.values(), key=lambda r: (r.mode, r.workload, r.num_adapters, r.cache, r.rate))
    if path is not None:
        path.write_text(json.dumps({"rows": [asdict(r) for r in merged]}, indent=2) + "\n")
    return merged


# ---- markdown ----

COLUMNS = ("run", "rate req/s", "requests (errors)", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
           "TPOT p50 ms", "TPOT p99 ms", "SLO met", "goodput req/s", "hit rate")


def _ms(value: float | None) -> str:
    return f"{1000 * value:.0f}" if value is not None else "-"


def _cells(row: RateRow) -> list[str]:
    hit = f"{row.hit_rate:.1%} ({row.hit_rate_source})" if row.hit_rate is not None else NOT_REPORTED
    return [row.run, f"{row.rate:g}", f"{row.num_requests} ({row.num_errors})", f"{row.requests_per_s:.2f}",
            f"{row.output_tokens_per_s:.0f}", _ms(row.ttft_p50_s), _ms(row.ttft_p99_s), _ms(row.tpot_p50_s),
            _ms(row.tpot_p99_s), "yes" if row.meets_slo else "no", f"{row.goodput:.2f}", hit]


def table(rows: list[RateRow]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return lines + ["| " + " | ".join(_cells(r)) + " |" for r in rows]


def max_goodput(rows: list[RateRow]) -> dict[str, float]:
    """run -> the highest goodput over its rates (0 when no rate met the SLO)."""
    best: dict[str, float] = {}
    for row in rows:
        best[row.run] = max(best.get(row.run, 0.0), row.goodput)
    return best


def retention_lines(rows: list[RateRow]) -> list[str]:
    """Max goodput per registered-adapter count, against the fewest registered, per cache setting and workload."""
    lines = []
    best = max_goodput(rows)
    groups: dict[tuple[str, str], dict[int, float]] = {}
    for row in rows:
        if row.mode == "retention":
            groups.setdefault((row.workload, row.cache), {})[row.num_adapters] = best[row.run]
    for (workload, cache), by_count in sorted(groups.items()):
        fewest = by_count[min(by_count)]
        cells = [f"{n}: {g:.2f} req/s" + (f" ({g / fewest:.3f}x)" if fewest else "")
                 for n, g in sorted(by_count.items())]
        lines.append(f"- {workload}, cache {cache}: " + "; ".join(cells))
    return lines


def render_markdown(rows: list[RateRow], env: dict[str, str], settings: dict[str, str], slo: Slo) -> str:

    text = ["# `kubelora bench serve` (written by the command)", "",
            *[f"- {k}: {v}" for k, v in {**env, **settings}.items()],
            f"- SLO: TTFT p99 <= {slo.ttft_p99_s * 1000:g} ms, TPOT p99 <= {slo.tpot_p99_s * 1000:g} ms", "",
            *table(rows), "", "Max goodput per run:", "",
            *[f"- {run}: {g:.2f} req/s" for run, g in sorted(max_goodput(rows).items())], ""]
    retention = retention_lines(rows)
    if retention:
        text += ["Retention (max goodput by registered adapters):", "", *retention, ""]
    text += ["## Targets", "", *target_lines(rows), ""]
    errors = [f"- {r.key}: {r.first_error}" for r in rows if r.first_error]
    if errors:
        text += ["First error per row:", "", *errors, ""]
    return "\n".join(text)
