"""The engine benchmark's results (`BenchResult`) and their markdown report."""

from __future__ import annotations

import json
import statistics
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from kubelora.bench import engine_long_context as long_context
from kubelora.bench.engine_assets import SHAPES, ModelShape
from kubelora.bench.engine_offline import Row
from kubelora.bench.engine_plan import EngineBenchConfig
from kubelora.bench.engine_targets import floors, prefill_rate, targets

METHOD = """\
Each row runs in the offline engine loop of a fresh `LLM` where its engine settings differ (bf16 on the GPU,
freed before the next engine starts): random prompt ids, greedy, every request generates exactly its token
count (ignore_eos). A row runs once untimed (warm-up, `warmup_tokens` per request), then `num_repeats` times
(the prefill rows `prefill_repeats` times); the table shows the median and the spread (min..max) of the
repeats. **ms/step** is the median wall time of the engine's own `step()` calls once every request has its
first token (each call returns the sampled ids, so it is a whole step); **tokens/s** is generated tokens over
a repeat's wall time, first request added to last token; **TTFT** is first_token_time - arrival_time per request. **vs base** is ms/step against our base
model at the same batch size from the same process. Compiled transformers runs in a subprocess (static cache,
generate's own torch.compile; ms/step from a per-step streamer stamp after a device sync). The bytes floor is
(weights + KV bytes read per step, averaged over the decode's contexts, a sliding layer's only inside its window +
distinct adapters' bytes) / the measured device-to-device copy rate (bytes read + written). HTTP is `kubelora engine serve` with the adapter engine's
limits, one streaming aiohttp client per request; its offline reference is the adapter engine's row of the
same requests."""


@dataclass
class BenchResult:
    config: EngineBenchConfig
    env: dict[str, str]
    shape: ModelShape | None = None
    copy_bytes_per_s: float | None = None
    matmul_flops: float | None = None
    rows: dict[str, Row] = field(default_factory=dict)
    engines: dict[str, dict] = field(default_factory=dict)
    hf: dict | None = None
    stages: list[tuple[str, float]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    total_s: float | None = None
    # One entry per process of the run (a checkpointed run has several): machine, UTC start, seconds.
    processes: list[dict] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # stages a checkpointed process left to the next one
    # Another run's base share of the bytes floor at the benchmark's batch (`--reference`; engine_targets.py)
    reference: dict | None = None

    @contextmanager
    def stage(self, name: str):
        """Time a stage; a failure is recorded (and printed) and the run goes on with the next stage."""
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            yield
        except Exception as exc:  # one broken scenario must not cost the rest of a device run
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        self.stages.append((name, time.perf_counter() - start))
        print(f"== {name}: {self.stages[-1][1]:.1f} s", flush=True)

    @contextmanager
    def timed(self, name: str):
        """Time a stage whose failure ends the run (what every later stage needs)."""
        start = time.perf_counter()
        yield
        self.stages.append((name, time.perf_counter() - start))

    def as_dict(self) -> dict:
        config = asdict(self.config)
        return {"env": self.env, "config": config, "shape": self.shape.as_dict() if self.shape else None,
                "copy_bytes_per_s": self.copy_bytes_per_s, "matmul_flops": self.matmul_flops,
                "rows": {k: r.as_dict() for k, r in self.rows.items()}, "engines": self.engines, "hf": self.hf,
                "floors": {f"{b}x{n}": vars(f) | {"ms": f.ms} for (b, n), f in floors(self).items()},
                "long_context_floors": {f"{context}x{n}": vars(f) | {"ms": f.ms}
                                        for (context, n), f in long_context.floors(self).items()},
                "targets": [vars(t) for t in targets(self)], "stages": self.stages, "errors": self.errors,
                "total_s": self.total_s, "processes": self.processes, "unfinished": self.unfinished,
                "reference": self.reference}


def _ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _spread(row: Row, attribute: str, scale: float = 1.0, digits: int = 2) -> str:
    spread = row.spread(attribute)
    return "-" if spread is None else f"{scale * spread[0]:.{digits}f}..{scale * spread[1]:.{digits}f}"


def _is_one_batch(row: Row) -> bool:
    """Whether the warm-up ran every request in one step; else ms/step is the last wave's, not the batch's."""
    return row.warmup is None or row.warmup.max_batch >= row.extra.get("num_requests", 0)


def _vs_base(result: BenchResult, row: Row) -> str:
    base = result.rows.get(f"base-b{row.extra.get('num_requests')}")
    if base is None or not row.median("decode_ms") or not base.median("decode_ms") or not _is_one_batch(row):
        return "-"
    return f"{row.median('decode_ms') / base.median('decode_ms'):.2f}x"


def _notes(result: BenchResult, row: Row) -> str:
    notes = []
    if row.warmup and row.warmup.max_batch:
        notes.append(f"warm-up: up to {row.warmup.max_batch} seqs / {row.warmup.max_adapters} adapters per step")
        if not _is_one_batch(row):
            notes.append("not one batch: ms/step is the last wave's")
    if row.key.startswith("torch-a"):
        notes.append(_agreement(row, result.rows.get("lora-a" + row.key[7:])))
    if row.key == "http":
        reference = result.rows.get(f"lora-a{result.config.num_adapters}")
        if reference:
            notes.append(f"offline: {reference.median('tokens_per_s'):.0f} tokens/s, TTFT p50/p99 "
                         f"{1e3 * reference.ttft(50):.0f}/{1e3 * reference.ttft(99):.0f} ms")
    return "; ".join(notes)


def _agreement(row: Row, default: Row | None) -> str:
    """How far the torch backend's greedy tokens agree with the default backend's on the same requests."""
    if default is None or not row.runs[-1].outputs or not default.runs[-1].outputs:
        return ""
    pairs = list(zip(row.runs[-1].outputs, default.runs[-1].outputs))
    same_first = sum(a[:1] == b[:1] for a, b in pairs)
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs)
    return (f"first token as the default backend's in {same_first} of {len(pairs)} requests, "
            f"{prefix / len(pairs):.1f} leading tokens on average")


def results_table(result: BenchResult) -> list[str]:
    lines = ["| row | requests | ms/step | ms/step spread | tokens/s | tokens/s spread | TTFT p50 / p99 ms | vs base "
             "| notes |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result.rows.values():
        if row.key.startswith(("prefill", long_context.KEY_PREFIX)):  # in their own tables
            continue
        p50, p99 = row.ttft(50), row.ttft(99)
        ttft = "-" if p50 is None else f"{1e3 * p50:.0f} / {1e3 * p99:.0f}"
        lines.append(f"| {row.label} | {row.extra.get('num_requests', '-')} | {_ms(row.median('decode_ms'))} | "
                     f"{_spread(row, 'decode_ms')} | {row.median('tokens_per_s'):.0f} | "
                     f"{_spread(row, 'tokens_per_s', digits=0)} | {ttft} | {_vs_base(result, row)} | "
                     f"{_notes(result, row)} |")
    return lines


def prefill_table(result: BenchResult) -> list[str]:
    c = result.config
    keys = [k for k in ("prefill-base", "prefill-lora") if k in result.rows]
    if not keys:
        return []
    tokens = c.prefill_prompts * c.prefill_len
    lines = ["| row | seconds | seconds spread | prompt tokens/s | model TFLOP/s | of the matmul rate |",
             "|---|---|---|---|---|---|"]
    for key in keys:
        row, rate = result.rows[key], prefill_rate(result, key)
        share = f"{rate / result.matmul_flops:.0%}" if rate and result.matmul_flops else "-"
        lines.append(f"| {row.label} | {row.median('seconds'):.3f} | {_spread(row, 'seconds', digits=3)} | "
                     f"{tokens / row.median('seconds'):.0f} | {rate / 1e12:.1f} | {share} |")
    return lines


def floor_table(result: BenchResult) -> list[str]:
    found = floors(result)
    if not found:
        return []
    lines = ["| batch | distinct adapters | bytes per step (GB) | floor ms/step | ours ms/step | ours / floor |",
             "|---|---|---|---|---|---|"]
    for (batch, count), floor in found.items():
        row = result.rows.get(f"base-b{batch}" if count == 0 else f"lora-a{count}")
        ours = row.median("decode_ms") if row else None
        ratio = f"{ours / floor.ms:.2f}x" if ours else "-"
        lines.append(f"| {batch} | {count} | {floor.step_bytes / 1e9:.2f} | {floor.ms:.3f} | {_ms(ours)} | {ratio} |")
    return lines


def family_table(result: BenchResult) -> list[str]:
    """One row of docs/benchmarks-engine.md's "Model families" table: base decode at batch 1 and the benchmark's
    batch against the bytes floor and compiled transformers, num_adapters adapters against the floor's cost."""
    c, found, rows = result.config, floors(result), result.rows
    if result.shape is None or not any(k.startswith("base-b") for k in rows):
        return []
    name = next((k for k, v in SHAPES.items() if v == result.shape), "custom")
    columns = ("shape", "batch 1 ms/step (/ floor)", "batch 1 vs compiled transformers",
               f"batch {c.batch} ms/step (share of floor)", f"batch {c.batch} vs compiled transformers",
               f"{c.num_adapters} adapters ms/step (with / without; floor's)")
    cells = [f"{name} ({result.shape.model_type})"]
    for batch in (1, c.batch):
        row, floor, hf = rows.get(f"base-b{batch}"), found.get((batch, 0)), rows.get(f"hf-b{batch}")
        ms = row.median("decode_ms") if row else None
        ratio = "-" if not (ms and floor) else (f"{ms / floor.ms:.2f}x" if batch == 1 else f"{floor.ms / ms:.0%}")
        cells.append(f"{_ms(ms)} ({ratio})")
        cells.append(f"{hf.median('decode_ms') / ms:.2f}x" if hf and ms and hf.median("decode_ms") else "-")
    lora, base = rows.get(f"lora-a{c.num_adapters}"), rows.get(f"base-b{c.batch}")
    with_floor, without = found.get((c.batch, c.num_adapters)), found.get((c.batch, 0))
    if lora and base and lora.median("decode_ms") and base.median("decode_ms") and with_floor and without:
        cells.append(f"{_ms(lora.median('decode_ms'))} ({lora.median('decode_ms') / base.median('decode_ms'):.3f}x; "
                     f"{with_floor.ms / without.ms:.3f}x)")
    else:
        cells.append("-")
    return [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns), f"| {' | '.join(cells)} |"]


def engines_table(result: BenchResult) -> list[str]:
    lines = ["| engine | settings | start-up s (its phases) | adapters registered (load s) | "
             "beyond weights+KV+pool GiB | "
             "allocated after close GiB |", "|---|---|---|---|---|---|"]
    for key, info in result.engines.items():
        extra, left = info.get("extra_device_bytes"), info.get("left_allocated_bytes")
        phases = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}"
                           for name, seconds in info.get("startup_phases_s", {}).items())
        startup = f"{info['startup_s']:.1f}" + (f" ({phases})" if phases else "")
        lines.append(f"| {key} | `{json.dumps(info['options'])}` | {startup} | "
                     f"{info.get('num_adapters_registered', 0)} ({info.get('adapter_load_s', 0):.1f}) | "
                     f"{_gib(extra)} | {_gib(left)} |")
    return lines


def _process_lines(result: BenchResult) -> list[str]:
    """Where a checkpointed run took several processes: how many, on how many machines, and when."""
    if len(result.processes) < 2 and not result.unfinished:
        return []
    machines = len({p["machine"] for p in result.processes})
    each = ", ".join(f"{p['started']} {p.get('seconds') or 0:.0f} s" for p in result.processes)
    lines = [f"- processes: {len(result.processes)} on {machines} machine{'s' if machines > 1 else ''} "
             f"(`--checkpoint`): {each}"]
    if result.unfinished:
        lines.append(f"- unfinished: {', '.join(result.unfinished)} not run yet (resume with the same --checkpoint)")
    return lines


def _gib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / (1 << 30):.2f}"


def profile_lines(result: BenchResult) -> list[str]:
    lines = []
    for row in result.rows.values():
        split = row.extra.get("profile")
        if not split:
            continue
        lines += ["", f"**{row.label}** ({split['num_steps']} decode steps under torch.profiler): "
                  f"{split['wall_ms_per_step']:.2f} ms/step wall, GPU busy {split['busy_ms_per_step']:.2f} ms "
                  f"({split['gpu_busy_share']:.0%}), kernel time {split['kernel_ms_per_step']:.2f} ms", "",
                  "| kernel | ms/step | launches/step | share of kernel time |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['ms_per_step']:.3f} | {k['launches_per_step']:.1f} | {k['share']:.0%} |"
                  for k in split["kernels"]]
    return lines


def targets_table(result: BenchResult) -> list[str]:
    lines = ["| target | measured | required | verdict |", "|---|---|---|---|"]
    lines += [f"| {t.name} | {t.measured} | {t.required} | {t.verdict} |" for t in targets(result)]
    return lines


def _ttft_split_lines(extra: dict) -> list[str]:
    """Where the single requests' TTFT went inside the server (its queue and prefill histograms), when measured."""
    cold, steady = extra.get("cold_split_s"), extra.get("steady_split_s")
    if not cold or not steady:
        return []
    prefills = [1e3 * prefill for _, prefill in steady]
    return ["", f"Inside the server (`kubelora_request_queue_time_seconds`, `..._prefill_time_seconds`): the first "
                f"request queued {1e3 * cold[0]:.1f} ms and its prefill took {1e3 * cold[1]:.1f} ms; the steady ones "
                f"queued {1e3 * max(q for q, _ in steady):.1f} ms at most and their prefills took "
                f"{min(prefills):.1f}..{max(prefills):.1f} ms (median {statistics.median(prefills):.1f})."]


def render_markdown(result: BenchResult) -> str:
    c = result.config
    workload = {k: v for k, v in asdict(c).items() if k not in ("shape", "device")}
    text = ["# Engine benchmark: base model, many adapters, prefill, transformers and HTTP, one run", "",
            "Written by `kubelora bench engine` (`bench/engine.py`); every raw number is in its `--json` output.", "",
            *[f"- {k}: {v}" for k, v in result.env.items()],
            f"- model shape: `{json.dumps(result.shape.as_dict() if result.shape else None)}`",
            f"- workload: `{json.dumps(workload)}`",
            f"- device rates: copy {(result.copy_bytes_per_s or 0) / 1e12:.2f} TB/s (read + write), "
            f"{c.matmul_size}^3 matmul {(result.matmul_flops or 0) / 1e12:.0f} TFLOP/s",
            f"- wall time: {result.total_s or 0:.0f} s (" + ", ".join(f"{n} {s:.0f} s" for n, s in result.stages) + ")",
            *_process_lines(result), "", METHOD, "", "## Results", "", *results_table(result)]
    for title, lines in (("Prefill", prefill_table(result)), ("Bytes floor", floor_table(result)),
                         ("Decode at long contexts", long_context.table(result)),
                         ("Model family row (docs/benchmarks-engine.md, \"Model families\")", family_table(result)),
                         ("Engines", engines_table(result))):
        if lines:
            text += ["", f"## {title}", "", *lines]
    if "http" in result.rows:
        extra = result.rows["http"].extra
        starts = ", ".join(f"{1e3 * cold:.0f} / {1e3 * steady:.0f}" for cold, steady
                           in zip(extra["cold_ttft_starts_s"], extra["steady_ttft_starts_s"]))
        text += ["", f"HTTP server: /ready after {', '.join(f'{s:.1f}' for s in extra['ready_starts_s'])} s over "
                 f"{len(extra['ready_starts_s'])} fresh starts; per start, the first request's TTFT against the median "
                 f"of {len(extra['steady_ttft_probes_s'])} single requests after it (ms): {starts}; flags as the adapter engine: "
                 f"`{json.dumps(extra['server'])}`.", *_ttft_split_lines(extra)]
    lacks = result.rows["http"].extra.get("server_lacks") if "http" in result.rows else None
    if lacks:
        text += ["", f"`kubelora engine serve` has no {', '.join(lacks)}: the server ran with EngineConfig's "
                 "default there while the offline engines did not."]
    profile = profile_lines(result)
    if profile:
        text += ["", "## Profile", *profile]
    text += ["", "## Targets", "", *targets_table(result)]
    if result.errors:
        text += ["", "## Errors", "", *[f"- {name}: {message}" for name, message in result.errors.items()]]
    return "\n".join(text) + "\n"
