"""The engine benchmark's rows, engine by engine: each engine a fresh `LLM`, freed before the next one starts.

- base engine: our base model at each batch size, and the base prefill;
- adapter engine (every adapter registered): distinct-adapter counts, mixed ranks and their mean rank,
  all-linear, registered but unused, prefill with adapters; the HTTP server gets the same limits;
- budget engine: a device pool for `budget_adapters` adapters under more adapters in flight;
- defaults engine: EngineConfig's own adapter limits and pool budget;
- long-context engines, one per context: base and adapter decode at that context (bench/engine_long_context.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubelora.bench import engine_long_context as long_context
from kubelora.bench.engine_device import device_bytes_in_use, free_device, is_cuda
from kubelora.bench.engine_hf import run_baseline
from kubelora.bench.engine_http import Server, ServerSettings, probe_ttft, run_clients, server_flags
from kubelora.bench.engine_offline import Row, RunStats, Workload, random_prompts, round_robin, time_row
from kubelora.bench.engine_plan import (EngineBenchConfig, adapter_plan, base_batches, lora_adapter_counts,
                                        needs_base_engine, needs_lora_engine, pool_bytes_for)
from kubelora.bench.engine_report import BenchResult

NUM_LOADERS = 8  # adapters registered at once (reading and hashing files releases the GIL)
# Single requests after the first one, for the server's steady-state TTFT: a short prefill is host-bound, and the
# prefill step of one and the same request took 21..42 ms on an H200 machine (docs/benchmarks-engine.md, "First request after /ready").
NUM_TTFT_PROBES = 9


class EngineRows:
    def __init__(self, config: EngineBenchConfig, result: BenchResult, model_dir: Path, paths: dict[str, Path]):
        self.config = config
        self.result = result
        self.model_dir = model_dir
        self.paths = paths
        self.plan = adapter_plan(config)

    # ---- workloads ----

    def decode(self, names: list[str], batch: int | None = None) -> Workload:
        """The decode workload: the same prompts for every row of one batch size, adapters round robin."""
        batch = batch or self.config.batch
        prompts = random_prompts(batch, self.config.prompt_len, self.result.shape.vocab_size, self.config.seed)
        return Workload(prompts, round_robin(names, batch), self.config.output_len)

    def structured(self) -> Workload:
        """The base decode workload of `batch` requests, `structured_requests` of them spread over the batch and
        constrained (half by a JSON schema, half by a regex, neither able to end before output_len tokens)."""
        from kubelora.bench.structured import constraint_specs

        c = self.config
        base = self.decode([], c.batch)
        specs, every = constraint_specs(), c.batch // c.structured_requests
        constrained = [None] * c.batch
        for i in range(c.structured_requests):
            constrained[i * every] = specs[i % len(specs)]
        return Workload(base.prompts, base.adapters, base.max_tokens, tuple(constrained))

    def prefill(self, names: list[str]) -> Workload:
        c = self.config
        prompts = random_prompts(c.prefill_prompts, c.prefill_len, self.result.shape.vocab_size, c.seed + 1)
        return Workload(prompts, round_robin(names, c.prefill_prompts), 1)

    def uniform_names(self, count: int) -> list[str]:
        return [s.name for s in self.plan.uniform[:count]]

    def _row(self, llm, key: str, label: str, workload: Workload, is_profiled: bool = False,
             is_tracked: bool = False) -> Row:
        c = self.config
        steps = c.profile_steps if is_profiled and c.is_profiled else 0
        repeats = c.prefill_repeats if key.startswith("prefill") else c.num_repeats
        row = time_row(llm, key, label, workload, c.device, repeats, c.warmup_tokens, is_tracked=is_tracked,
                       profile_steps=steps)
        row.extra["num_requests"] = len(workload.prompts)
        self.result.rows[key] = row
        return row

    # ---- engines ----

    def offline_steps(self) -> list[tuple[str, Callable[[], None]]]:
        c = self.config
        steps = []
        if needs_base_engine(c):
            steps.append(("base engine", self.run_base_engine))
        if needs_lora_engine(c):
            steps.append(("adapter engine", self.run_lora_engine))
        if c.has("budget"):
            steps.append(("budget engine", self.run_budget_engine))
        if c.has("defaults"):
            steps.append(("defaults engine", self.run_defaults_engine))
        if c.has("torch-backend"):
            steps.append(("torch-backend engine", self.run_torch_engine))
        if c.has("long-context"):  # one engine, and one stage, per context: a resumed run picks up between them
            steps += [(f"long-context engine, {context} tokens",
                       lambda context=context: self.run_long_context_engine(context)) for context in c.long_contexts]
        return steps

    def _with_engine(self, key: str, options: dict, adapters: dict[str, bool], body) -> None:
        """A fresh LLM with `options`, `adapters` (name -> preload) registered, body(llm), then freed."""
        from kubelora.engine import LLM

        c = self.config
        common = {"device": c.device, "dtype": "bfloat16" if is_cuda(c.device) else "auto",
                  "max_model_len": c.max_model_len, "enforce_eager": c.is_eager, **dict(c.engine_switches)}
        if c.max_num_batched_tokens:
            common["max_num_batched_tokens"] = c.max_num_batched_tokens
        start = time.perf_counter()
        llm = LLM(self.model_dir, **{**common, **options})  # options win: an engine sized for its own rows
        info = {"options": options, "startup_s": time.perf_counter() - start,
                "startup_phases_s": dict(getattr(llm.engine, "startup_seconds", {})), **self._memory(llm)}
        self.result.engines[key] = info
        try:
            start = time.perf_counter()
            with ThreadPoolExecutor(NUM_LOADERS) as loaders:
                list(loaders.map(lambda kv: llm.load_adapter(kv[0], self.paths[kv[0]], preload=kv[1]),
                                 adapters.items()))
            info.update(num_adapters_registered=len(adapters), adapter_load_s=time.perf_counter() - start)
            body(llm)
        finally:
            llm.close()
            del llm
            free_device(c.device)
            info["left_allocated_bytes"] = device_bytes_in_use(c.device)

    def _memory(self, llm) -> dict:
        """Device memory after start-up beyond weights, KV cache and adapter pool (graphs, workspaces, slack)."""
        if not is_cuda(self.config.device):
            return {}
        import torch

        shape, engine = self.result.shape, llm.engine
        kv = engine.num_kv_blocks * 2 * shape.num_layers * engine.config.kv_block_size * shape.num_kv_heads \
            * shape.head_dim * 2
        pool = engine.snapshot().adapter_pool_total_bytes
        weights = shape.checkpoint_bytes()
        reserved = torch.cuda.memory_reserved()
        return {"reserved_bytes": reserved, "kv_bytes": kv, "pool_bytes": pool,
                "extra_device_bytes": reserved - weights - kv - pool}

    def run_base_engine(self) -> None:
        c = self.config
        batches = base_batches(c)
        options = {"max_num_seqs": max(batches + [c.prefill_prompts if c.has("prefill") else 1])}

        def body(llm) -> None:
            for batch in batches:
                self._row(llm, f"base-b{batch}", f"base, batch {batch}", self.decode([], batch),
                          is_profiled=batch in (1, c.batch))
            if c.has("prefill"):
                self._row(llm, "prefill-base", f"prefill {c.prefill_prompts} x {c.prefill_len}, base",
                          self.prefill([]))
            if c.has("structured"):
                self._row(llm, "structured", f"batch {c.batch}, {c.structured_requests} of them structured "
                          "(JSON schema, regex)", self.structured())

        self._with_engine("base", options, {}, body)

    def lora_limits(self) -> dict:
        """The adapter engine's limits, which the HTTP server gets too: room for its largest row's adapters."""
        c = self.config
        counts = lora_adapter_counts(c)
        if {"mixed", "all-linear"} & set(c.scenarios):
            counts.append(c.num_adapters)
        if c.has("prefill"):
            counts.append(c.prefill_adapters)
        max_loras = max(counts, default=1)
        return {"max_loras": max_loras, "max_lora_rank": self.plan.max_rank,
                "max_cpu_loras": max(len(self.plan.all()), max_loras), "max_num_seqs": c.batch}

    def run_lora_engine(self) -> None:
        c, plan = self.config, self.plan
        adapters = {s.name: i < plan.num_preloaded for i, s in enumerate(plan.uniform)}
        adapters.update({s.name: True for s in plan.mixed + plan.mean_rank + plan.all_linear})
        n, batch, r = c.num_adapters, c.batch, c.rank

        def body(llm) -> None:
            for count in lora_adapter_counts(c):
                self._row(llm, f"lora-a{count}", f"batch {batch}, {count} adapters r{r}",
                          self.decode(self.uniform_names(count)), is_profiled=count == n)
            if c.has("mixed"):
                ranks = "/".join(map(str, c.mixed_ranks))
                self._row(llm, "mixed", f"batch {batch}, {n} adapters, ranks {ranks}",
                          self.decode([s.name for s in plan.mixed]))
                self._row(llm, "mean-rank", f"batch {batch}, {n} adapters, rank {c.uniform_rank} (their mean)",
                          self.decode([s.name for s in plan.mean_rank]))
            if c.has("all-linear"):
                self._row(llm, "all-linear", f"batch {batch}, {n} adapters r{r} all-linear",
                          self.decode([s.name for s in plan.all_linear]))
            if c.has("unused"):
                self._row(llm, "unused", f"batch {batch}, {len(adapters)} adapters registered "
                          f"({sum(adapters.values())} preloaded), none used", self.decode([]))
            if c.has("prefill"):
                k = c.prefill_adapters
                self._row(llm, "prefill-lora", f"prefill {c.prefill_prompts} x {c.prefill_len}, {k} adapters r{r}",
                          self.prefill(self.uniform_names(k)))

        self._with_engine("adapters", self.lora_limits(), adapters, body)

    def run_budget_engine(self) -> None:
        c = self.config
        names = self.uniform_names(c.num_adapters)
        options = {"max_loras": c.num_adapters, "max_lora_rank": c.rank, "max_cpu_loras": c.num_adapters,
                   "max_num_seqs": c.batch,
                   "max_lora_pool_bytes": pool_bytes_for(self.result.shape, c.budget_adapters, c.rank,
                                                         2 if is_cuda(c.device) else 4)}  # bf16 / CPU float32
        label = f"{c.batch} requests over {c.num_adapters} adapters, device budget for {c.budget_adapters}"
        self._with_engine("budget", options, dict.fromkeys(names, True),
                          lambda llm: self._row(llm, "budget", label, self.decode(names)))

    def run_defaults_engine(self) -> None:
        c = self.config
        names = self.uniform_names(c.num_adapters)
        options = {"max_cpu_loras": max(16, c.num_adapters), "max_num_seqs": c.batch}
        label = f"{c.batch} requests over {c.num_adapters} adapters, EngineConfig's adapter defaults"
        self._with_engine("defaults", options, dict.fromkeys(names, True),
                          lambda llm: self._row(llm, "defaults", label, self.decode(names)))

    def run_torch_engine(self) -> None:
        c = self.config
        counts = lora_adapter_counts(c)
        names = self.uniform_names(max(counts))

        def body(llm) -> None:
            for count in counts:
                self._row(llm, f"torch-a{count}", f"batch {c.batch}, {count} adapters r{c.rank}, torch backend",
                          self.decode(names[:count]))

        self._with_engine("torch-backend", {**self.lora_limits(), "lora_backend": "torch"},
                          dict.fromkeys(names, True), body)

    def run_long_context_engine(self, context: int) -> None:
        c = self.config
        names = self.uniform_names(c.long_adapters)

        def body(llm) -> None:
            for n in long_context.adapter_counts(c):
                # Tracked in the timed repeats (host reads between steps, beside steps of tens of ms): the warm-up
                # prefills in chunks, so its first sequences can finish before its last start; a repeat's cached
                # prompts start every sequence in one step.
                self._row(llm, long_context.row_key(context, n), long_context.row_label(c, context, n),
                          long_context.workload(c, self.result.shape.vocab_size, context, names[:n]), is_tracked=True)

        self._with_engine(f"long-context {context}", long_context.engine_options(c, context),
                          dict.fromkeys(names, True), body)

    # ---- subprocesses ----

    def run_hf(self, out_json: Path) -> None:
        c = self.config
        raw = run_baseline(self.model_dir, out_json, c.device, c.hf_batches, c.prompt_len, c.output_len,
                           c.num_repeats, is_compiled=is_cuda(c.device), timeout_s=c.hf_timeout_s)
        self.result.hf = raw
        if "error" in raw:
            raise RuntimeError(f"the transformers baseline failed: {raw['error']}")
        for entry in raw["batches"]:
            runs = [RunStats(r["seconds"], r["num_tokens"], r["decode_ms"], c.output_len,
                             [r["ttft_s"]] if r["ttft_s"] is not None else []) for r in entry["runs"]]
            batch = entry["batch"]
            self.result.rows[f"hf-b{batch}"] = Row(f"hf-b{batch}", f"compiled transformers, batch {batch}", runs,
                                                   extra={"num_requests": batch, "warmup_s": entry["warmup_s"]})

    def server_engine_flags(self) -> tuple[list[str], list[str]]:
        """The offline engines' extra settings as `engine serve` flags, and those the server has no flag for."""
        c = self.config
        wanted = {"--enforce-eager": [] if c.is_eager else None,
                  "--max-num-batched-tokens": [str(c.max_num_batched_tokens)] if c.max_num_batched_tokens else None}
        known = server_flags()
        flags = [part for flag, values in wanted.items() if values is not None and flag in known
                 for part in (flag, *values)]
        return flags, [flag for flag, values in wanted.items() if values is not None and flag not in known]

    def run_http(self, log_path: Path) -> None:
        c = self.config
        names = self.uniform_names(c.num_adapters)
        limits = self.lora_limits()
        flags, missing = self.server_engine_flags()
        settings = ServerSettings(self.model_dir, {n: self.paths[n] for n in names}, c.device,
                                  max_model_len=c.max_model_len, engine_flags=tuple(flags), **limits)
        workload = self.decode(names)
        single = Workload(workload.prompts[:1], workload.adapters[:1], min(4, c.output_len))
        starts = []  # per fresh server: (seconds to /ready, the first request's probe, the steady probes)

        def start(is_timed: bool) -> tuple[RunStats | None, list[RunStats]]:
            server = Server(settings, log_path)
            try:
                ready_s = server.wait_ready(c.server_timeout_s)
                cold = probe_ttft(server.url, single)
                probes = [probe_ttft(server.url, single) for _ in range(NUM_TTFT_PROBES)]
                starts.append((ready_s, cold, probes))
                if not is_timed:
                    return None, []
                warmup = run_clients(server.url, workload.with_max_tokens(min(c.warmup_tokens, c.output_len)))
                return warmup, [run_clients(server.url, workload) for _ in range(c.num_repeats)]
            finally:
                server.stop()

        warmup, runs = start(True)
        for _ in range(c.server_starts - 1):
            start(False)
        ready_s, cold, probes = starts[0]
        colds = [first[0] for _, first, _ in starts]
        steadies = [statistics.median(ttft for ttft, _, _ in steady) for _, _, steady in starts]
        extra = {"num_requests": len(workload.prompts), "ready_s": ready_s,
                 # the first request after /ready and the steady single requests, medians over the fresh starts
                 "cold_ttft_s": statistics.median(colds), "steady_ttft_s": statistics.median(steadies),
                 "cold_ttft_starts_s": colds, "steady_ttft_starts_s": steadies,
                 "ready_starts_s": [ready for ready, _, _ in starts],
                 # the first server's single requests: TTFT, (queue, prefill) seconds inside the server
                 "steady_ttft_probes_s": [ttft for ttft, _, _ in probes],
                 "cold_split_s": list(cold[1:]), "steady_split_s": [list(p[1:]) for p in probes],
                 "server": {**limits, "flags": flags}, "server_lacks": missing}
        self.result.rows["http"] = Row("http", f"HTTP, {c.batch} streams over {c.num_adapters} adapters", runs,
                                       warmup, extra)
        print(f"  HTTP: ready {ready_s:.1f} s, " + ", ".join(f"{r.seconds:.2f} s" for r in runs), flush=True)
