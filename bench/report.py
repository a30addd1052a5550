"""The kernel benchmark's table, its targets (`KERNEL_TARGETS`) and the markdown report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

BASELINES = ("gather+bmm", "loop", "torch ref")

# The kernel targets, named by what they measure. A decode shape's bytes floor says which limit applies: from
# BANDWIDTH_BOUND_FLOOR_US on, the share of the copy bandwidth; under LATENCY_BOUND_FLOOR_US, the time per call.
BANDWIDTH_BOUND_FLOOR_US = 5.0
LATENCY_BOUND_FLOOR_US = 2.0
MIN_COPY_BW_SHARE = 0.5  # floor us / ours us, bandwidth-bound decode shapes
MAX_LATENCY_BOUND_US = 10.0  # ours us per call, latency-bound decode shapes
MAX_PREFILL_US = 60.0  # ours us per call, the prefill shape
MIN_SPEEDUP_OVER_TORCH = 3.0  # best PyTorch baseline us / ours us, at SPEEDUP_ADAPTER_COUNTS adapters
SPEEDUP_ADAPTER_COUNTS = (8, 32)
MAX_MIXED_OVER_MEAN_RANK = 1.2  # a mixed-rank shape's us over the uniform shape's at the mean rank


@dataclass
class Row:
    name: str
    nbytes: int  # bytes the op must move at least
    floor_us: float  # nbytes over the measured copy bandwidth
    error: float  # our delta vs the reference's, relative norm
    block_m: int  # launch shape: 16 decode ... 64 prefill
    times: dict[str, float] = field(default_factory=dict)  # method -> us per call

    @property
    def best_baseline(self) -> float:
        return min((self.times[b] for b in BASELINES if b in self.times), default=float("nan"))

    def targets(self) -> list[str]:
        """The kernel targets that apply to this row, each with its verdict."""
        ours = self.times["ours"]
        out = []
        if self.name.startswith("prefill"):
            out.append(f"<={MAX_PREFILL_US:g}us {_verdict(ours <= MAX_PREFILL_US)}")
        elif self.floor_us >= BANDWIDTH_BOUND_FLOOR_US:
            out.append(f">={MIN_COPY_BW_SHARE:.0%} BW {_verdict(self.floor_us / ours >= MIN_COPY_BW_SHARE)}")
        elif self.floor_us < LATENCY_BOUND_FLOOR_US:
            out.append(f"<={MAX_LATENCY_BOUND_US:g}us {_verdict(ours <= MAX_LATENCY_BOUND_US)}")
        num_adapters = self.name.split(" x ")[1:2]
        if (num_adapters and num_adapters[0] in {str(n) for n in SPEEDUP_ADAPTER_COUNTS}
                and self.best_baseline == self.best_baseline):  # NaN: no baseline timed
            speedup = self.best_baseline / ours
            out.append(f">={MIN_SPEEDUP_OVER_TORCH:g}x torch {_verdict(speedup >= MIN_SPEEDUP_OVER_TORCH)}")
        return out


def _verdict(is_met: bool) -> str:
    return "met" if is_met else "MISSED"


def format_table(rows: list[Row], header: bool = True) -> str:
    cols = ["shape (tokens x adapters x rank)", "tile", "floor us", "ours us", "ours GB/s", "% copy BW",
            *[f"{b} us" for b in BASELINES], "best torch / ours", "rel err", "targets"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] if header else []
    for r in rows:
        ours = r.times["ours"]
        cells = [r.name, str(r.block_m), f"{r.floor_us:.1f}", f"{ours:.1f}", f"{r.nbytes / ours / 1e3:.0f}",
                 f"{100 * r.floor_us / ours:.0f}%",
                 *[f"{r.times[b]:.1f}" if b in r.times else "-" for b in BASELINES],
                 f"{r.best_baseline / ours:.1f}x", f"{r.error:.1e}", ", ".join(r.targets())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mixed_rank_lines(rows: list[Row]) -> list[str]:
    """Each mixed-rank row against the uniform row of the same tokens at the mean rank (the next row)."""
    lines = []
    for mixed, uniform in zip(rows, rows[1:]):
        if "mixed" in mixed.name:
            ratio = mixed.times["ours"] / uniform.times["ours"]
            lines.append(f"- {mixed.name}: {mixed.times['ours']:.1f} us vs {uniform.name}: "
                         f"{uniform.times['ours']:.1f} us, ratio {ratio:.2f} "
                         f"(target <= {MAX_MIXED_OVER_MEAN_RANK:g}: {_verdict(ratio <= MAX_MIXED_OVER_MEAN_RANK)})")
    return lines


def write_markdown(path: str, env: dict[str, str], table: str, rows: list[Row], tune_lines: list[str]) -> None:
    text = [
        "# Kernel benchmark: multi-LoRA shrink+expand (QKV, hidden 4096 -> 3 x 4096, bf16)", "",
        "Written by `kubelora bench kernels --write docs/benchmarks.md` (`bench/kernels.py`). The",
        "end-to-end engine benchmark (many adapters against the base model) is docs/benchmarks-engine.md; what",
        "tenant API keys cost the router (CPU per request, added latency) is docs/benchmarks-router-keys.md.", "",
        *[f"- {k}: {v}" for k, v in env.items()], "",
        "GPU time per call, each call captured in a CUDA graph over independent input sets rotated past the",
        "60 MiB L2, median of 7 trials. Floor: the distinct adapters' weights at their own ranks + x + y read",
        "and written, over the copy bandwidth measured in the same run. Decode shapes interleave the adapters",
        "(uniform, shuffled); `ours` is the Triton shrink + expand, each step's own launch (`choose_config`:",
        "2 launches per call; on 16- and 32-token tiles the expand is launched early, Hopper programmatic",
        "dependent launch, and on 16-token tiles the shrink too, behind the kernel before it; decode steps",
        "of at most 2 tokens per adapter tile, of rank <= 16 or from 32 tiles on, of one token on fewer",
        "tiles, or of at most 8 tokens at rank <= 8 run the GEMV shrink; other decode steps run one shrink",
        "program per slice, of 32 rank lanes on steps of more than 8 tiles at rank > 16; decode steps of at",
        "least 32 tiles of at most 8 tokens, except 2-token tiles at rank > 16, stack the expand's column",
        "sub-blocks in its product's rows, and those of at least 16 full tiles take 512 columns per expand",
        "program of 4 warps (256-wide in_dim steps in the shrink at rank > 16); the decode expand adds its",
        "delta into y by atomic adds);",
        "`gather+bmm` pads every adapter to the batch's max rank and gathers per token; `loop` is one",
        "adapter at a time (8 kernels per adapter); `torch ref` is kubelora's own reference path.", "",
        table, "", "Mixed ranks against the uniform batch at the mean rank:", "", *mixed_rank_lines(rows), "",
    ]
    if tune_lines:
        text += ["Variants timed in the same run (us per call, ours; `--compare` / `--tune`):", "",
                 *[f"- {line}" for line in tune_lines], ""]
    Path(path).write_text("\n".join(text))
