"""The engine benchmark's targets against one run: each measured, met or missed by how much.

The limits are the table below, each named by what it measures (max_*: an upper limit, min_*: a lower one).

A ratio's spread comes from the repeats (the worst and best pairing of the two rows' repeats); where the limit
lies inside it, the verdict says the repeats straddle the limit.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kubelora.bench import engine_long_context as long_context
from kubelora.bench.engine_device import Floor, decode_floor, prefill_flops
from kubelora.bench.engine_assets import AdapterSpec

GIB = 1 << 30

# ms/step of our base model over the bytes floor at batch 1.
MAX_BATCH1_OVER_FLOOR = 1.30
# The bytes floor over our base model's ms/step at the benchmark's batch.
MIN_FLOOR_SHARE = 0.70
# The bytes floor over ms/step of each long-context row (its context's KV and its adapters counted in the floor).
MIN_LONG_CONTEXT_FLOOR_SHARE = 0.70
# Compiled transformers' ms/step over ours, at each of its batch sizes: Llama shapes, the other families.
MIN_SPEEDUP_OVER_TRANSFORMERS = 1.50
MIN_FAMILY_SPEEDUP_OVER_TRANSFORMERS = 1.30
# Another family's share of the bytes floor at the benchmark's batch: at most this far (points) below the
# reference run's (the Llama-2-7B shape's, `--reference`).
MAX_FLOOR_SHARE_BELOW_REFERENCE = 0.10
# (ms/step with num_adapters distinct adapters / without) over (their bytes floors' ratio), at the benchmark's batch.
MAX_ADAPTER_COST_OVER_FLOOR_COST = 1.10
# Distinct adapters at the benchmark's batch -> ms/step over our base model at that batch.
MAX_ADAPTERS_OVER_BASE = {32: 1.10, 64: 1.19}
# Mixed ranks' ms/step over a uniform batch at their mean rank.
MAX_MIXED_OVER_MEAN_RANK = 1.20
# ms/step with many adapters registered and none used, over our base model.
MAX_UNUSED_OVER_BASE = 1.02
# The base prefill's model FLOP/s over the device's measured matmul rate.
MIN_PREFILL_MATMUL_SHARE = 0.70
# Prefill seconds with adapters over the base prefill's.
MAX_PREFILL_ADAPTERS_OVER_BASE = 1.05
# HTTP tokens/s over the offline engine's on the same requests.
MIN_HTTP_OVER_OFFLINE = 0.90
# The first request's TTFT after /ready over the steady single requests' median.
MAX_FIRST_REQUEST_OVER_STEADY = 1.20
# Tokens/s with some requests grammar-constrained over the same batch unconstrained.
MIN_STRUCTURED_OVER_NONE = 0.85
# A device pool for fewer adapters than are in flight, against all of them fitting: TTFT p99 at most, tokens/s at
# least. The throughput limit is a floor against regressions, not a goal: budget_adapters adapters' requests fill
# only their share of a step's sequences.
MAX_BUDGET_TTFT_P99_OVER_FIT = 3.00
MIN_BUDGET_THROUGHPUT_OVER_FIT = 0.35
# Seconds to capture the base engine's graphs at start-up.
MAX_CAPTURE_S = 30.0
# Device memory after start-up beyond weights, KV cache and adapter pool, GiB.
MAX_EXTRA_DEVICE_GIB = 3.0


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    required: str
    verdict: str


def _verdict(value: float | None, limit: float, is_upper: bool, spread: tuple[float, float] | None = None) -> str:
    if value is None:
        return "not measured"
    is_met = value <= limit if is_upper else value >= limit
    margin = abs(value / limit - 1) * 100
    text = f"met ({margin:.0f}% margin)" if is_met else f"missed by {margin:.0f}%"
    if spread and spread[0] <= limit <= spread[1]:
        text += f"; the repeats straddle the limit ({spread[0]:.2f}..{spread[1]:.2f})"
    return text


def _ratio(result, key_a: str, key_b: str, attribute: str = "decode_ms"):
    """(median a / median b, spread) of two rows, or (None, None) when either is missing."""
    a, b = result.rows.get(key_a), result.rows.get(key_b)
    if a is None or b is None or not a.median(attribute) or not b.median(attribute):
        return None, None
    (a_lo, a_hi), (b_lo, b_hi) = a.spread(attribute), b.spread(attribute)
    return a.median(attribute) / b.median(attribute), (a_lo / b_hi, a_hi / b_lo)


def reference_share(data: dict, batch: int) -> dict | None:
    """From another run's JSON (`--json`): its base share of the bytes floor at `batch`, with its shape and device;
    None where that run has no such row."""
    floor, row = data.get("floors", {}).get(f"{batch}x0"), data.get("rows", {}).get(f"base-b{batch}")
    steps = [r["decode_ms"] for r in row["runs"] if r.get("decode_ms")] if row else []
    if not floor or not steps:
        return None
    return {"share": floor["ms"] / statistics.median(steps), "shape": data.get("shape"),
            "device": data.get("env", {}).get("device")}


def floors(result) -> dict[tuple[int, int], Floor]:
    """(batch, distinct adapters) -> bytes floor, for every decode row measured."""
    c, shape = result.config, result.shape
    if shape is None or not result.copy_bytes_per_s:
        return {}
    adapter = AdapterSpec("r", c.rank).num_bytes(shape)
    cases = {(int(k[6:]), 0) for k in result.rows if k.startswith("base-b")}
    cases |= {(c.batch, int(k[6:])) for k in result.rows if k.startswith("lora-a")}
    return {(b, n): decode_floor(shape, b, c.prompt_len, c.output_len, n * adapter, n, result.copy_bytes_per_s)
            for b, n in sorted(cases)}


def prefill_rate(result, key: str) -> float | None:
    """Model FLOP/s of a prefill row (median seconds)."""
    row, c = result.rows.get(key), result.config
    if row is None or result.shape is None:
        return None
    return prefill_flops(result.shape, c.prefill_prompts, c.prefill_len) / row.median("seconds")


def targets(result) -> list[Target]:
    return [*_floor_targets(result), *_long_context_targets(result), *_hf_targets(result), *_adapter_targets(result),
            *_prefill_targets(result), *_serving_targets(result), *_startup_targets(result)]


def _floor_targets(result) -> list[Target]:
    c, found, out = result.config, floors(result), []
    row = result.rows.get("base-b1")
    if (1, 0) in found and row and row.median("decode_ms"):
        ms, floor = row.median("decode_ms"), found[(1, 0)].ms
        lo, hi = row.spread("decode_ms")
        out.append(Target("base, batch 1: ms/step against the bytes floor", f"{ms / floor:.2f}x ({ms:.2f} / "
                          f"{floor:.2f} ms)", f"<= {MAX_BATCH1_OVER_FLOOR:.2f}x",
                          _verdict(ms / floor, MAX_BATCH1_OVER_FLOOR, True, (lo / floor, hi / floor))))
    row = result.rows.get(f"base-b{c.batch}")
    if (c.batch, 0) in found and row and row.median("decode_ms"):
        ms, floor = row.median("decode_ms"), found[(c.batch, 0)].ms
        lo, hi = row.spread("decode_ms")
        out.append(Target(f"base, batch {c.batch}: share of the bytes floor bound", f"{floor / ms:.0%} ({floor:.2f} "
                          f"/ {ms:.2f} ms)", f">= {MIN_FLOOR_SHARE:.0%}",
                          _verdict(floor / ms, MIN_FLOOR_SHARE, False, (floor / hi, floor / lo))))
        reference = result.reference
        if reference:
            limit = reference["share"] - MAX_FLOOR_SHARE_BELOW_REFERENCE
            out.append(Target(f"base, batch {c.batch}: share of the bytes floor against the reference run's "
                              f"({reference['shape'].get('model_type')} {reference['shape'].get('hidden_size')}, "
                              f"{reference['device']})", f"{floor / ms:.0%} (reference {reference['share']:.0%})",
                              f">= {limit:.0%} ({100 * MAX_FLOOR_SHARE_BELOW_REFERENCE:.0f} points below it at most)",
                              _points_verdict(floor / ms, limit, (floor / hi, floor / lo))))
    return out


def _long_context_targets(result) -> list[Target]:
    c, out = result.config, []
    for (context, n), floor in long_context.floors(result).items():
        row = result.rows[long_context.row_key(context, n)]
        ms = row.median("decode_ms")
        if not ms:
            continue
        lo, hi = row.spread("decode_ms")
        out.append(Target(f"{long_context.row_label(c, context, n)}: share of the bytes floor bound",
                          f"{floor.ms / ms:.0%} ({floor.ms:.2f} / {ms:.2f} ms)",
                          f">= {MIN_LONG_CONTEXT_FLOOR_SHARE:.0%}",
                          _verdict(floor.ms / ms, MIN_LONG_CONTEXT_FLOOR_SHARE, False, (floor.ms / hi, floor.ms / lo))))
    return out


def _points_verdict(share: float, limit: float, spread: tuple[float, float]) -> str:
    """A share against a lower limit, met or missed by how many points of the floor."""
    points = 100 * (share - limit)
    text = f"met ({points:.0f} points margin)" if points >= 0 else f"missed by {-points:.0f} points"
    if spread[0] <= limit <= spread[1]:
        text += f"; the repeats straddle the limit ({spread[0]:.0%}..{spread[1]:.0%})"
    return text


def _hf_targets(result) -> list[Target]:
    out = []
    is_llama = result.shape is None or result.shape.model_type == "llama"
    limit = MIN_SPEEDUP_OVER_TRANSFORMERS if is_llama else MIN_FAMILY_SPEEDUP_OVER_TRANSFORMERS
    for batch in result.config.hf_batches:
        value, spread = _ratio(result, f"hf-b{batch}", f"base-b{batch}")
        if f"hf-b{batch}" in result.rows or result.config.has("hf"):
            out.append(Target(f"batch {batch}: speed-up over compiled transformers (its ms/step / ours)",
                              f"{value:.2f}x" if value else "-", f">= {limit:.2f}x",
                              _verdict(value, limit, False, spread)))
    return out


def _adapter_targets(result) -> list[Target]:
    c, out = result.config, []
    base = f"base-b{c.batch}"
    for count, limit in MAX_ADAPTERS_OVER_BASE.items():
        if f"lora-a{count}" in result.rows:
            value, spread = _ratio(result, f"lora-a{count}", base)
            out.append(Target(f"batch {c.batch}, {count} distinct adapters: ms/step against our base",
                              f"{value:.2f}x" if value else "-", f"<= {limit:.2f}x",
                              _verdict(value, limit, True, spread)))
    out += _adapter_floor_targets(result)
    checks = [("mixed", "mean-rank", f"mixed ranks against a uniform batch at their mean rank ({c.uniform_rank})",
               MAX_MIXED_OVER_MEAN_RANK),
              ("unused", base, "adapters registered but unused: ms/step against our base", MAX_UNUSED_OVER_BASE)]
    for key, reference, name, limit in checks:
        if key in result.rows:
            value, spread = _ratio(result, key, reference)
            out.append(Target(name, f"{value:.3f}x" if value else "-", f"<= {limit:.2f}x",
                              _verdict(value, limit, True, spread)))
    return out


def _adapter_floor_targets(result) -> list[Target]:
    """num_adapters distinct adapters: the step's cost (ms/step with them over without) against the bytes floor's
    (the floor with their bytes over the floor without)."""
    c, found = result.config, floors(result)
    key, with_floor, without = f"lora-a{c.num_adapters}", found.get((c.batch, c.num_adapters)), found.get((c.batch, 0))
    if key not in result.rows or not with_floor or not without:
        return []
    step, spread = _ratio(result, key, f"base-b{c.batch}")
    floor_ratio = with_floor.ms / without.ms
    value = step / floor_ratio if step else None
    return [Target(f"batch {c.batch}, {c.num_adapters} adapters: (ms/step with / without) over (floor with / without)",
                   f"{value:.3f}x ({step:.3f} / {floor_ratio:.3f})" if value else "-",
                   f"<= {MAX_ADAPTER_COST_OVER_FLOOR_COST:.2f}x",
                   _verdict(value, MAX_ADAPTER_COST_OVER_FLOOR_COST, True,
                            (spread[0] / floor_ratio, spread[1] / floor_ratio) if spread else None))]


def _prefill_targets(result) -> list[Target]:
    out = []
    rate = prefill_rate(result, "prefill-base")
    if rate and result.matmul_flops:
        out.append(Target("prefill: model FLOP/s against the measured matmul rate", f"{rate / result.matmul_flops:.0%} "
                          f"({rate / 1e12:.0f} / {result.matmul_flops / 1e12:.0f} TFLOP/s)",
                          f">= {MIN_PREFILL_MATMUL_SHARE:.0%}",
                          _verdict(rate / result.matmul_flops, MIN_PREFILL_MATMUL_SHARE, False)))
    if "prefill-lora" in result.rows:
        value, spread = _ratio(result, "prefill-lora", "prefill-base", "seconds")
        out.append(Target(f"prefill with {result.config.prefill_adapters} adapters: time against the base's",
                          f"{value:.3f}x" if value else "-", f"<= {MAX_PREFILL_ADAPTERS_OVER_BASE:.2f}x",
                          _verdict(value, MAX_PREFILL_ADAPTERS_OVER_BASE, True, spread)))
    return out


def _serving_targets(result) -> list[Target]:
    c, out = result.config, []
    fit = f"lora-a{c.num_adapters}"
    if "http" in result.rows:
        value, spread = _ratio(result, "http", fit, "tokens_per_s")
        out.append(Target("HTTP tokens/s against the offline engine on the same requests",
                          f"{value:.0%}" if value else "-", f">= {MIN_HTTP_OVER_OFFLINE:.0%}",
                          _verdict(value, MIN_HTTP_OVER_OFFLINE, False, spread)))
        extra = result.rows["http"].extra
        cold, steady, colds = extra["cold_ttft_s"], extra["steady_ttft_s"], extra["cold_ttft_starts_s"]
        ratio = cold / steady
        measured = (f"{ratio:.2f}x ({1e3 * cold:.0f} / {1e3 * steady:.0f} ms, medians over {len(colds)} fresh "
                    f"servers; their first requests {1e3 * min(colds):.0f}..{1e3 * max(colds):.0f} ms)")
        # The spread: the fastest and the slowest start's first request against the median steady one.
        out.append(Target("first request after /ready: TTFT against the steady state", measured,
                          f"<= {MAX_FIRST_REQUEST_OVER_STEADY:.2f}x",
                          _verdict(ratio, MAX_FIRST_REQUEST_OVER_STEADY, True,
                                   (min(colds) / steady, max(colds) / steady))))
    if "structured" in result.rows:
        value, spread = _ratio(result, "structured", f"base-b{c.batch}", "tokens_per_s")
        out.append(Target(f"{c.structured_requests} of {c.batch} requests structured: tokens/s against none",
                          f"{value:.2f}x" if value else "-", f">= {MIN_STRUCTURED_OVER_NONE:.2f}x",
                          _verdict(value, MIN_STRUCTURED_OVER_NONE, False, spread)))
    if "budget" in result.rows:
        budget, reference = result.rows["budget"], result.rows.get(fit)
        p99 = budget.ttft(99) / reference.ttft(99) if reference and reference.ttft(99) else None
        out.append(Target(f"budget for {c.budget_adapters}: TTFT p99 against all {c.num_adapters} fitting",
                          f"{p99:.2f}x" if p99 else "-", f"<= {MAX_BUDGET_TTFT_P99_OVER_FIT:.2f}x",
                          _verdict(p99, MAX_BUDGET_TTFT_P99_OVER_FIT, True)))
        value, spread = _ratio(result, "budget", fit, "tokens_per_s")
        out.append(Target(f"budget for {c.budget_adapters}: tokens/s against all fitting",
                          f"{value:.2f}x" if value else "-", f">= {MIN_BUDGET_THROUGHPUT_OVER_FIT:.2f}x",
                          _verdict(value, MIN_BUDGET_THROUGHPUT_OVER_FIT, False, spread)))
    if "defaults" in result.rows and result.rows["defaults"].warmup:
        seen = result.rows["defaults"].warmup
        is_met = seen.max_batch >= c.batch and seen.max_adapters >= c.num_adapters
        out.append(Target(f"defaults: {c.batch} requests over {c.num_adapters} adapters in one batch",
                          f"most in one step: {seen.max_batch} sequences, {seen.max_adapters} adapters",
                          f"{c.batch} and {c.num_adapters}", "met" if is_met else "missed"))
    return out


def _startup_targets(result) -> list[Target]:
    info = result.engines.get("base")
    if not info or "extra_device_bytes" not in info:
        return []
    extra, startup = info["extra_device_bytes"], info["startup_s"]
    seconds = info.get("startup_phases_s", {}).get("capture")
    limit = f"<= {MAX_CAPTURE_S:.0f} s"
    if result.config.is_eager:
        capture = Target("graph capture time", "-", limit, "not measured: --enforce-eager captures no graphs")
    elif seconds is None:  # an engine that does not time its phases: the whole start-up bounds it
        capture = Target("graph capture time (the base engine's whole start-up)", f"{startup:.1f} s", limit,
                         "met (start-up, weights included, is within it)" if startup <= MAX_CAPTURE_S else
                         "not separated: start-up includes loading the weights")
    else:
        capture = Target("graph capture time (the base engine's decode and prefill graphs)",
                         f"{seconds:.1f} s (whole start-up {startup:.1f} s)", limit,
                         _verdict(seconds, MAX_CAPTURE_S, True))
    return [capture,
            Target("device memory beyond weights, KV cache and adapter pool after start-up", f"{extra / GIB:.2f} GiB",
                   f"<= {MAX_EXTRA_DEVICE_GIB:.0f} GiB", _verdict(extra / GIB, MAX_EXTRA_DEVICE_GIB, True))]
