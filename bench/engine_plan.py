"""The engine benchmark's settings and what follows from them: scenarios, adapter sets, engines and their rows.

Nothing here touches the device; `bench/engine.py` runs the plan.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from kubelora.bench.engine_assets import ATTENTION, MLP, SHAPES, AdapterSpec, ModelShape

# The scenarios a run does by default, each selectable with --scenarios; only when named: "torch-backend" (the
# adapter rows on the PyTorch reference LoRA backend, and how far its greedy tokens agree with the default
# backend's) and "long-context" (decode at long_contexts tokens of context, bench/engine_long_context.py: its KV
# cache needs the memory of a whole H200 at the Llama-3.1-8B shape).
DEFAULT_SCENARIOS = ("base", "adapters", "mixed", "all-linear", "unused", "budget", "defaults", "prefill", "hf",
                     "floor", "http", "structured")
SCENARIOS = DEFAULT_SCENARIOS + ("torch-backend", "long-context")
# Scenarios whose rows are compared with our base model at the adapter batch size.
_NEEDS_BASE_BATCH = {"adapters", "mixed", "all-linear", "unused", "budget", "defaults", "floor", "http",
                     "torch-backend", "structured"}


@dataclass(frozen=True)
class EngineBenchConfig:
    device: str = "cuda"
    shape: ModelShape = SHAPES["7b"]
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    prompt_len: int = 128
    output_len: int = 128
    num_repeats: int = 3  # timed repeats per row, after one warm-up
    warmup_tokens: int = 16  # tokens per request in the warm-up pass
    base_batches: tuple[int, ...] = (1, 16, 64, 256)
    batch: int = 64  # requests in the adapter rows, the budget rows and through HTTP
    adapter_counts: tuple[int, ...] = (8, 32, 64)
    num_adapters: int = 32  # distinct adapters of the mixed, all-linear, budget, defaults and HTTP rows
    num_registered: int = 200  # rank-`rank` adapters registered in the adapter engine
    rank: int = 16
    mixed_ranks: tuple[int, ...] = (8, 24, 32, 64)  # cycled over the mixed row's adapters
    budget_adapters: int = 8  # the budget row's device pool holds this many rank-`rank` adapters
    prefill_prompts: int = 16
    prefill_len: int = 1024
    prefill_adapters: int = 8
    # Timed repeats of the two prefill rows: a repeat takes a fraction of a second, and their ratio (target 1.05x)
    # is of two rows measured apart, so more repeats than the decode rows' keep the medians steady.
    prefill_repeats: int = 9
    structured_requests: int = 8  # of the structured row's `batch` requests, constrained by a grammar
    matmul_size: int = 8192
    copy_bytes: int = 2 << 30
    hf_batches: tuple[int, ...] = (1, 64)
    long_contexts: tuple[int, ...] = (8192, 32768)  # prompt tokens of the long-context rows, one engine each
    long_batch: int = 16  # requests of a long-context row
    long_adapters: int = 16  # distinct rank-`rank` adapters of the long-context adapter rows
    hf_timeout_s: float = 420.0
    server_timeout_s: float = 300.0
    # Fresh `engine serve` processes whose first request after /ready is timed; the target compares the medians.
    server_starts: int = 5
    is_eager: bool = False  # EngineConfig.enforce_eager for every offline engine
    is_profiled: bool = False
    profile_steps: int = 20
    max_num_batched_tokens: int | None = None  # None: EngineConfig's default (the server's too)
    # EngineConfig switches of every offline engine (from KUBELORA_GEMV, KUBELORA_BLAS, ... at the entry point;
    # the server row's engine reads the same variables itself)
    engine_switches: tuple[tuple[str, object], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.scenarios) - set(SCENARIOS))
        if unknown or not self.scenarios:
            raise ValueError(f"scenarios must be a non-empty subset of {','.join(SCENARIOS)}, got {unknown or '[]'}")
        for name in ("prompt_len", "output_len", "num_repeats", "warmup_tokens", "batch", "num_adapters",
                     "num_registered", "rank", "budget_adapters", "prefill_prompts", "prefill_len",
                     "prefill_adapters", "prefill_repeats", "structured_requests", "matmul_size", "copy_bytes",
                     "profile_steps", "server_starts", "long_batch", "long_adapters"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineBenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("base_batches", "adapter_counts", "mixed_ranks", "hf_batches", "long_contexts"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"EngineBenchConfig.{name} must be non-empty integers >= 1, got {getattr(self, name)}")
        if self.structured_requests > self.batch:
            raise ValueError(f"structured_requests ({self.structured_requests}) must be <= batch ({self.batch})")
        if max(self.adapter_counts) > self.batch or self.num_adapters > self.batch:
            raise ValueError(f"adapter_counts and num_adapters must be <= batch ({self.batch}): every adapter of a "
                             f"row has a request")
        if self.long_adapters > self.long_batch:
            raise ValueError(f"long_adapters ({self.long_adapters}) must be <= long_batch ({self.long_batch}): every "
                             f"adapter of a row has a request")
        if max(self.adapter_counts) > self.num_registered:
            raise ValueError(f"num_registered ({self.num_registered}) must be >= adapter_counts "
                             f"({max(self.adapter_counts)})")

    def has(self, scenario: str) -> bool:
        return scenario in self.scenarios

    @property
    def max_model_len(self) -> int:
        """Prompt + output of the decode rows, or a prefill prompt and its one token; a multiple of 16."""
        need = self.prompt_len + self.output_len
        if self.has("prefill"):
            need = max(need, self.prefill_len + 1)
        return 16 * math.ceil(need / 16)

    @property
    def uniform_rank(self) -> int:
        """The mixed row's mean rank: the uniform row it is compared with."""
        return round(statistics.mean(self.mixed_ranks))


# ---- adapters ----

@dataclass(frozen=True)
class AdapterPlan:
    uniform: list[AdapterSpec]  # rank-`rank` q,k,v,o: adapter, unused, budget, defaults, prefill, HTTP, long context
    num_preloaded: int  # of `uniform`, how many are staged in host memory at registration (the rest: known)
    mixed: list[AdapterSpec] = field(default_factory=list)
    mean_rank: list[AdapterSpec] = field(default_factory=list)
    all_linear: list[AdapterSpec] = field(default_factory=list)

    def all(self) -> list[AdapterSpec]:
        return self.uniform + self.mixed + self.mean_rank + self.all_linear

    @property
    def max_rank(self) -> int:
        return max(s.rank for s in self.all())


def adapter_plan(config: EngineBenchConfig) -> AdapterPlan:
    used = set()
    if config.has("adapters"):
        used.update(config.adapter_counts)
    if config.has("prefill"):
        used.add(config.prefill_adapters)
    if {"budget", "defaults", "http", "torch-backend"} & set(config.scenarios):
        used.add(config.num_adapters)
    if config.has("long-context"):
        used.add(config.long_adapters)
    num_preloaded = max(used, default=1)
    num_uniform = config.num_registered if {"adapters", "unused"} & set(config.scenarios) else num_preloaded
    r = config.rank
    plan = AdapterPlan(uniform=[AdapterSpec(f"r{r}-{i}", r) for i in range(max(num_uniform, num_preloaded))],
                       num_preloaded=num_preloaded)
    n = config.num_adapters
    if config.has("mixed"):
        ranks = config.mixed_ranks
        plan.mixed.extend(AdapterSpec(f"mix-{i}", ranks[i % len(ranks)]) for i in range(n))
        plan.mean_rank.extend(AdapterSpec(f"u{config.uniform_rank}-{i}", config.uniform_rank) for i in range(n))
    if config.has("all-linear"):
        plan.all_linear.extend(AdapterSpec(f"al{r}-{i}", r, ATTENTION + MLP) for i in range(n))
    return plan


def pool_bytes_for(shape: ModelShape, num_adapters: int, rank: int, element_size: int) -> int:
    """max_lora_pool_bytes holding num_adapters adapters of `rank`: EngineConfig's rule, rank rows of every
    module (q, k, v, o, gate, up, down) in every layer, in the engine's dtype."""
    per_rank_row = element_size * shape.num_layers * sum(sum(shape.module_dims(m)) for m in ATTENTION + MLP)
    return num_adapters * rank * per_rank_row


# ---- engines and their rows ----

def base_batches(config: EngineBenchConfig) -> list[int]:
    """Batch sizes the base engine runs: the base rows, the reference for adapter rows, the HF comparison."""
    batches = set(config.base_batches) if config.has("base") else set()
    if _NEEDS_BASE_BATCH & set(config.scenarios):
        batches.add(config.batch)
    if config.has("floor"):
        batches.add(1)
    if config.has("hf"):
        batches.update(config.hf_batches)
    return sorted(batches)


def lora_adapter_counts(config: EngineBenchConfig) -> list[int]:
    """Distinct-adapter counts of the adapter engine's rows; HTTP and budget compare with num_adapters."""
    counts = set(config.adapter_counts) if config.has("adapters") else set()
    if {"http", "budget", "torch-backend"} & set(config.scenarios):
        counts.add(config.num_adapters)
    return sorted(counts)


def needs_lora_engine(config: EngineBenchConfig) -> bool:
    return bool(lora_adapter_counts(config)) or bool({"mixed", "all-linear", "unused", "prefill"}
                                                     & set(config.scenarios))


def needs_base_engine(config: EngineBenchConfig) -> bool:
    return bool(base_batches(config)) or config.has("prefill")
