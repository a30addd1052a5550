"""The hostile-tenant benchmark's table, its targets and the markdown report."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

from kubelora.bench.hostile_measure import ClassResult

if TYPE_CHECKING:
    from kubelora.bench.hostile import HostileReport

MAX_HEALTH_P99_MS = 100.0
MAX_VICTIM_RATIO = 2.0
COLUMNS = ("class", "hostile status", "/health p99 ms", "/health max ms", "/health samples",
           "victim ms beside twin / hostile", "victim ratio", "victim = alone", "targets")


def status_text(result: ClassResult) -> str:
    statuses = "/".join(str(s) for s in sorted(set(result.statuses)))
    return f"refused {statuses}" if result.is_refused else statuses


def targets(result: ClassResult) -> list[str]:
    """Each target with its verdict: /health p99 (no /health error either) and the victim ratio."""
    is_health_met = result.health_p99_ms < MAX_HEALTH_P99_MS and result.num_health_errors == 0
    ratio = result.victim_ratio
    return [f"p99 < {MAX_HEALTH_P99_MS:.0f} ms {'met' if is_health_met else 'MISSED'}",
            f"ratio <= {MAX_VICTIM_RATIO:.0f}x {'met' if ratio <= MAX_VICTIM_RATIO else 'MISSED'}"]


def row(result: ClassResult) -> dict[str, str]:
    errors = f" ({result.num_health_errors} failed)" if result.num_health_errors else ""
    ratio = result.victim_ratio
    victim_ms = (1e3 * statistics.median(t) for t in (result.plain_victim_s, result.hostile_victim_s))
    return dict(zip(COLUMNS, (
        result.name, status_text(result), f"{result.health_p99_ms:.1f}{errors}", f"{result.health_max_ms:.1f}",
        str(len(result.health_s)), " / ".join(f"{ms:.0f}" for ms in victim_ms),
        f"{ratio:.2f}x" if math.isfinite(ratio) else "-", "yes" if result.is_victim_equal else "NO",
        ", ".join(targets(result)))))


def format_table(results: list[ClassResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r).values()) + " |" for r in results]
    return "\n".join(lines)


def render_markdown(report: HostileReport) -> str:
    config = report.config
    shape = ", ".join(f"{k} {v}" for k, v in report.shape.items())
    model = str(config.model_dir) if config.model_dir else "a random tiny llama (cli/tiny.py)"
    text = [
        "# Hostile-tenant benchmark", "",
        "Written by `kubelora bench hostile --write docs/benchmarks-hostile.md` (`bench/hostile.py`). Against a live",
        "`kubelora engine serve` on loopback, each class's hostile request (built at the server's current limits,",
        "`bench/hostile_classes.py`) runs beside a victim: a greedy base-model completion of the same token count",
        "on another connection, while a thread GETs `/health` every 20 ms. Each repeat first runs the victim beside",
        "the class's plain twin (the same request without what makes it hostile; for the adapter-load class, the",
        "load of a plain config), then beside the hostile request. Victim ratio: the median victim time beside the",
        "hostile request over the median beside the twin (both medians in ms too). `/health` p99 and max: over the",
        "GETs of the hostile runs (`samples` of them: a run lasts as long as its slower answer). Victim =",
        "alone: every hostile run's victim answered the text it answers alone. A class whose hostile request is",
        "answered 4xx in every repeat is `refused`.", "",
        *[f"- {k}: {v}" for k, v in report.env.items()],
        f"- model: {model}; {shape}",
        f"- requests: prompt {config.prompt_len} tokens, max_tokens {config.max_tokens} (ignore_eos); "
        f"{config.num_repeats} repeats per class", "",
    ]
    if report.note:
        text += [report.note, ""]
    text += [format_table(report.results), ""]
    return "\n".join(text)
