"""The router-keys benchmark's tables, its targets and the markdown report.

CPU per request is a median over the repeats, with their middle half beside it; its ratio to the open arm is
taken within each repeat first, where the arms ran back to back, then summarised the same way. p50 and p99 are
over every repeat's requests of an arm together (a p99 of one repeat rests on a handful of requests); the p99
difference to the open arm is that of the pooled p99s, the per-repeat differences' middle half beside it.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubelora.bench.router_keys import ArmSample, RouterKeysReport

MAX_CPU_RATIO = 1.02  # router CPU per request, keys on / off
MAX_ADDED_P99_MS = 1.0  # p99 latency, keys on minus off
KEYED_ARMS = ("keys", "keys+limits")
CONTROL_ARM = "open-control"  # a second open router: the difference two identical routers show
COLUMNS = ("variant", "arm", "router CPU us/request", "CPU / open", "p50 ms", "p99 ms", "p99 - open ms", "targets")
KEY_PATH_COLUMNS = ("arm", "key path us/request (in-process)", "over open us", "open router CPU us/request",
                    "implied CPU / open")


def percentile(values: tuple[float, ...] | list[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def cpu_us(sample: ArmSample) -> float:
    return sample.router_cpu_s / len(sample.latencies_s) * 1e6


def spread(values: list[float], digits: int) -> str:
    """'median [p25-p75]' over the repeats: the middle half, as a min-max over many repeats of a shared machine
    would show its rarest stalls."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    low, high = percentile(values, 25), percentile(values, 75)
    return f"{median:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def pooled(samples: list[ArmSample]) -> list[float]:
    return [t for s in samples for t in s.latencies_s]


def by_repeat(samples: list[ArmSample], variant: str, arm: str) -> list[ArmSample]:
    return sorted((s for s in samples if s.variant == variant and s.arm == arm), key=lambda s: s.repeat)


def comparisons(samples: list[ArmSample], variant: str, arm: str) -> tuple[list[float], list[float]]:
    """Per repeat: router CPU per request over the open arm's, and p99 minus the open arm's (ms)."""
    pairs = list(zip(by_repeat(samples, variant, arm), by_repeat(samples, variant, "open")))
    ratios = [cpu_us(s) / cpu_us(o) for s, o in pairs]
    added = [1e3 * (percentile(s.latencies_s, 99) - percentile(o.latencies_s, 99)) for s, o in pairs]
    return ratios, added


def added_p99_ms(samples: list[ArmSample], variant: str, arm: str) -> float:
    """p99 over every repeat's requests of the arm minus the same of the open arm."""
    own, open_ = (pooled(by_repeat(samples, variant, a)) for a in (arm, "open"))
    return 1e3 * (percentile(own, 99) - percentile(open_, 99))


def targets(ratios: list[float], added_ms: float) -> str:
    ratio = statistics.median(ratios)
    return (f"CPU <= {MAX_CPU_RATIO:.2f}x {'met' if ratio <= MAX_CPU_RATIO else 'MISSED'}, "
            f"p99 +<= {MAX_ADDED_P99_MS:g} ms {'met' if added_ms <= MAX_ADDED_P99_MS else 'MISSED'}")


def row(samples: list[ArmSample], variant: str, arm: str) -> dict[str, str]:
    own = by_repeat(samples, variant, arm)
    p50, p99 = (f"{1e3 * percentile(pooled(own), q):.3f}" for q in (50, 99))
    cpu = spread([cpu_us(s) for s in own], 0) if arm != "engine" else "-"
    ratio = added = verdict = "-"
    if arm in (CONTROL_ARM, *KEYED_ARMS):
        ratios, added_per_repeat = comparisons(samples, variant, arm)
        added_ms = added_p99_ms(samples, variant, arm)
        ratio = spread(ratios, 3)
        verdict = targets(ratios, added_ms) if arm in KEYED_ARMS else "(control: as open)"
        added = f"{added_ms:.3f} [{percentile(added_per_repeat, 25):.3f}-{percentile(added_per_repeat, 75):.3f}]"
    return dict(zip(COLUMNS, (variant, arm, cpu, ratio, p50, p99, added, verdict)))


def format_table(columns: tuple[str, ...], rows: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def measured_rows(report: RouterKeysReport) -> list[dict[str, str]]:
    from kubelora.bench.router_keys import ARMS, VARIANTS

    return [row(report.samples, variant, arm) for variant in VARIANTS for arm in ARMS]


def key_path_rows(report: RouterKeysReport) -> list[dict[str, str]]:
    """The key path timed alone, against the sequential open router's CPU per request."""
    open_us = statistics.median(cpu_us(s) for s in by_repeat(report.samples, "sequential", "open"))
    rows = []
    for arm in KEYED_ARMS:
        extra = report.key_path_us[arm] - report.key_path_us["open"]
        rows.append(dict(zip(KEY_PATH_COLUMNS, (arm, f"{report.key_path_us[arm]:.2f}", f"{extra:.2f}",
                                                f"{open_us:.0f}", f"{1 + extra / open_us:.4f}"))))
    return rows


def render_markdown(report: RouterKeysReport) -> str:
    from kubelora.bench.router_keys import NUM_KEY_PATH_ROUNDS, ROUTER_ARMS

    config = report.config
    text = [
        "# Router benchmark: tenant API keys on against off", "",
        "Written by `kubelora bench router-keys --write docs/benchmarks-router-keys.md` (`bench/router_keys.py`).",
        "One fake engine (an aiohttp process answering a fixed JSON completion at once) behind four `kubelora",
        "router --placement-file` processes, one per arm: `open` (the placement has no `apiKeys`), `open-control`",
        "(the same again), `keys` (a table of keys, each granted a few adapters) and `keys+limits` (the same table",
        "with `requestsPerMinute` and `tokensPerMinute` on every key, high enough never to refuse: a bucket costs",
        "the same whatever its limit). `engine` is the floor: the same requests straight to the engine.", "",
        "A keep-alive aiohttp client sends completions one at a time (sequential) and from several clients at once",
        "(concurrent), with one key's `Authorization: Bearer` header in every arm (an OpenAI SDK always sends one;",
        "an open router passes it on unread), rotating over that key's adapters. The arms take turns request by",
        "request, so each gets the same share of the same seconds of the machine. Router CPU: each router",
        "process's CPU clock (every thread, ns resolution) read around a block of requests. Between blocks the",
        "routers swap arms (each is handed another placement and reads it at once); a repeat is one block per",
        "router role, so every process has played every arm. Without the swap, two identical open routers",
        "differed by 4-7% in CPU per request on this machine, a process's own bias, larger than the 2% target;",
        "`open-control` shows what is left of it.", "",
        "`router CPU` and `CPU / open` are medians over the repeats, the middle half of the repeats in brackets;",
        "the ratio is taken within each repeat. p50 and p99 are over all repeats' requests of an arm together;",
        "`p99 - open` is the difference of those p99s, the per-repeat differences' middle half in brackets. The",
        "targets are judged on the median ratio and the pooled p99 difference.", "",
        *[f"- {k}: {v}" for k, v in report.env.items()],
        f"- shapes: {config.num_keys} keys in the table, {config.num_granted} adapters per key "
        f"({config.num_keys * config.num_granted} in the placement, all on the one engine); {config.num_requests} "
        f"requests per arm and block, {len(ROUTER_ARMS)} blocks a repeat, {config.num_repeats} repeats "
        f"({config.num_requests * len(ROUTER_ARMS) * config.num_repeats} requests per arm and variant), "
        f"{config.num_warmup} warm-up requests per arm; concurrent: {config.concurrency} clients", "",
    ]
    if report.note:
        text += [report.note, ""]
    text += [format_table(COLUMNS, measured_rows(report)), "",
             "The key path alone (`KeyTable.authorize`, `KeyTable.check`, `KeyLimits.admit_request`, as",
             "`handle_inference` calls them), timed in the benchmark's process: the fastest of "
             f"{NUM_KEY_PATH_ROUNDS} rounds of {config.num_key_path_calls}",
             "calls per arm; `open` is the open pool's `authorize`, which returns at once. The implied ratio adds",
             "the difference to the open router's CPU per request (sequential, median). The measured ratios above",
             "are higher: the loop here keeps the key path's code and data in the caches, while in the router each",
             "request finds them evicted by everything else the machine ran since.", "",
             f"- open pool's key path: {report.key_path_us['open']:.2f} us/request", "",
             format_table(KEY_PATH_COLUMNS, key_path_rows(report)), ""]
    return "\n".join(text)
