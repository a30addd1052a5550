"""Real-traffic benchmark: `kubelora bench serve [--mode sweep|retention] [--write FILE] [--rows FILE.json]`.

An open-loop load generator (bench/serve_client.py) against `kubelora engine serve` (started by
bench/engine_http.py), with the traffic of bench/serve_workload.py: Poisson arrivals at each rate of a sweep,
adapters by Zipf popularity, a fixed system prompt per tenant, multi-turn chats that carry their history.

- `--mode sweep`: one server start per cache setting (`--cache on,off`: with and without
  `--no-enable-prefix-caching`), every rate on each; a row per rate (bench/serve_report.py).
- `--mode retention` (S-LoRA's experiment): for each of `--retention-counts` registered adapters, all in the host
  tier (the engine's `--max-cpu-loras` = the count), the rates swept with the cache off (`--cache off`, the
  default here) and `--workload uniform` (S-LoRA's lengths); the report gives the max goodput per count against
  the fewest.

Each command writes its own rows; with `--rows FILE` they are merged into FILE (a row of the same run and rate
is replaced) and the report covers every row there, so a benchmark can span several device calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kubelora.bench.command import publish, refuse, work_folder
from kubelora.bench.serve_client import Traffic, prefix_cache_counters, run_conversations
from kubelora.bench.serve_report import RateRow, Slo, merge_rows, rate_row, render_markdown
from kubelora.bench.serve_workload import Conversation, TextMaker, WorkloadConfig, WorkloadKind, build_conversations

CACHE_OFF_FLAG = "--no-enable-prefix-caching"
CACHE_SETTINGS = ("on", "off")
MODES = ("sweep", "retention")
NUM_CALIBRATION_WORDS = 2000
CONTEXT_MARGIN = 0.9  # of --max-model-len: room for the chat template and re-tokenized answers


@dataclass(frozen=True)
class ServeBenchConfig:
    mode: str = "sweep"
    workload: WorkloadConfig = WorkloadConfig()
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    duration_s: float = 60.0
    caches: tuple[str, ...] = CACHE_SETTINGS
    retention_counts: tuple[int, ...] = (5, 100, 1000, 2000)
    device: str = "cuda"
    shape: str = "8b"
    model_dir: Path | None = None
    rank: int = 8
    max_loras: int = 32
    max_num_seqs: int = 256
    max_model_len: int = 16384
    server_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    warmup_requests: int = 8
    slo: Slo = Slo()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"rates must be > 0 requests per second, got {self.rates}")
        if self.duration_s <= 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if not self.caches or set(self.caches) - set(CACHE_SETTINGS):
            raise ValueError(f"cache must be a comma list of {', '.join(CACHE_SETTINGS)}, got {self.caches}")
        if not self.retention_counts or min(self.retention_counts) < 1:
            raise ValueError(f"retention counts must be >= 1, got {self.retention_counts}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup requests must be >= 0, got {self.warmup_requests}")

    def adapter_counts(self) -> tuple[int, ...]:
        return self.retention_counts if self.mode == "retention" else (self.workload.num_adapters,)


# ---- assets ----

def prepare_model(config: ServeBenchConfig, workdir: Path) -> Path:
    from kubelora.bench.engine_assets import SHAPES, write_model

    model_dir = config.model_dir or workdir / "model"
    if not (model_dir / "config.json").exists():
        shape = SHAPES[config.shape]
        write_model(model_dir, shape, config.device)
    return model_dir


def prepare_adapters(config: ServeBenchConfig, model_dir: Path, root: Path) -> tuple[str, ...]:
    """Rank-`rank` q/k/v/o adapters t0000.. under root, as many as the largest count; files already there kept."""
    from kubelora.bench.engine_assets import AdapterSpec, shape_of, write_adapters

    names = tuple(f"t{i:04d}" for i in range(max(config.adapter_counts())))
    missing = [AdapterSpec(name, config.rank) for name in names if not _has_adapter(root / name, config.rank)]
    write_adapters(root, missing, shape_of(model_dir), model_dir, config.device)
    return names


def _has_adapter(path: Path, rank: int) -> bool:
    try:
        return (json.loads((path / "adapter_config.json").read_text()).get("r") == rank
                and (path / "adapter_model.safetensors").exists())
    except (OSError, ValueError):
        return False


def tokens_per_word(model_dir: Path) -> float:
    """The model tokenizer's tokens per word of the workload's text (serve_workload.WORDS)."""
    from tokenizers import Tokenizer  # the fast tokenizer's file alone: no transformers (and torch) import

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    words = TextMaker(1.0).text(NUM_CALIBRATION_WORDS, 0)
    return len(tokenizer.encode(words, add_special_tokens=False).ids) / NUM_CALIBRATION_WORDS


# ---- runs ----

def cache_flags(available: frozenset[str]) -> dict[str, tuple[str, ...]] | None:
    """The server flags of each cache setting, or None when the server has no switch for its prefix cache."""
    if CACHE_OFF_FLAG not in available and "--enable-prefix-caching" not in available:
        return None
    return {"on": (), "off": (CACHE_OFF_FLAG,)}


def run(config: ServeBenchConfig, workdir: Path) -> tuple[list[RateRow], list[str]]:
    """Every run of the plan: its rows, and notes on what could not run."""
    from kubelora.bench.engine_http import server_flags

    model_dir = prepare_model(config, workdir)
    names = prepare_adapters(config, model_dir, workdir / "adapters")
    text = TextMaker(tokens_per_word(model_dir))
    switch = cache_flags(server_flags())
    notes = [] if switch is not None else [f"the server has no `{CACHE_OFF_FLAG}`: one run with its default cache "
                                           "behaviour (`cache default`), none with the cache off"]
    caches = config.caches if switch is not None else ("default",)
    rows = []
    for count in config.adapter_counts():
        workload = replace(config.workload, num_adapters=count)
        for cache in caches:
            flags = switch[cache] if switch is not None else ()
            rows += _run_server(config, workload, model_dir, {n: workdir / "adapters" / n for n in names[:count]},
                                cache, flags, text, workdir / f"server-{count}-{cache}.log")
    return rows, notes


def _run_server(config: ServeBenchConfig, workload: WorkloadConfig, model_dir: Path, adapters: dict[str, Path],
                cache: str, flags: tuple[str, ...], text: TextMaker, log_path: Path) -> list[RateRow]:
    from kubelora.bench.engine_http import Server, ServerSettings

    run_name = f"{config.mode} {workload.kind.value} {workload.num_adapters} adapters, cache {cache}"
    print(f"== {run_name}", flush=True)
    settings = ServerSettings(model_dir, adapters, config.device, max_loras=min(config.max_loras, len(adapters)),
                              max_lora_rank=config.rank, max_cpu_loras=max(len(adapters), config.max_loras),
                              max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                              engine_flags=flags)
    server = Server(settings, log_path)
    try:
        server.wait_ready(config.server_timeout_s)
        traffic = Traffic(server.url, tuple(adapters), workload, text, int(config.max_model_len * CONTEXT_MARGIN),
                          config.request_timeout_s)
        asyncio.run(run_conversations(traffic, _warmup(config.warmup_requests, len(adapters))))
        rows = []
        for index, rate in enumerate(config.rates):
            conversations = build_conversations(workload, rate, config.duration_s, seed=index)
            before = prefix_cache_counters(server.url)
            records = asyncio.run(run_conversations(traffic, conversations))
            after = prefix_cache_counters(server.url)
            delta = {k: after[k] - before[k] for k in after} if before is not None and after is not None else None
            row = rate_row(run_name, config.mode, workload.kind.value, workload.num_adapters, cache, rate, records,
                           config.slo, delta)
            print(f"  rate {rate:g}: {row.num_requests} requests, {row.requests_per_s:.2f} req/s, "
                  f"meets SLO: {row.meets_slo}", flush=True)
            rows.append(row)
        return rows
    finally:
        server.stop()


def _warmup(num_requests: int, num_adapters: int) -> list[Conversation]:
    """Short single-turn requests over the first adapters, not measured (first-use costs: graphs, loads)."""
    return [Conversation(adapter=i % num_adapters, start_s=0.0, system_tokens=0, user_tokens=(16,),
                         answer_tokens=(4,), think_s=(), text_seed=10**6 + i) for i in range(num_requests)]


# ---- command line ----

def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _pair(text: str) -> tuple[int, int]:
    low, high = _ints(text)
    return low, high


# `--preset smoke`: a tiny model on the CPU, a run of seconds (tests/test_bench_serve.py); flags beside it win.
SMOKE = {"device": "cpu", "shape": "tiny", "num_adapters": 3, "rates": (4.0, 8.0), "duration": 1.0,
         "system_tokens": (24, 48), "turns": (3, 4), "prompt_mean": 8.0, "answer_mean": 3.0, "max_prompt": 16,
         "max_answer": 6, "think": 0.0, "max_loras": 2, "max_num_seqs": 16, "max_model_len": 512,
         "warmup_requests": 2, "retention_counts": (2, 3), "server_timeout": 120.0, "request_timeout": 60.0}


def build_parser(preset: str | None = None) -> argparse.ArgumentParser:
    c, w = ServeBenchConfig(), WorkloadConfig()
    p = argparse.ArgumentParser(prog="kubelora bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["smoke"], help="a tiny CPU run")
    p.add_argument("--write", help="write the markdown report to this file (it is always printed)")
    p.add_argument("--rows", type=Path, help="merge this command's rows into this JSON file; report them all")
    p.add_argument("--workdir", help="model and adapters, kept (default: a temporary folder)")
    p.add_argument("--model-dir", type=Path, help="use this model directory (written there when it has none)")
    p.add_argument("--shape", choices=["8b", "7b", "tiny"], default=c.shape, help="shape of a model to write")
    p.add_argument("--device", default=c.device)
    p.add_argument("--mode", choices=MODES, default=c.mode)
    p.add_argument("--workload", choices=[k.value for k in WorkloadKind], default=None,
                   help="chat (default; uniform in retention mode), no-prefix, uniform")
    p.add_argument("--cache", default=None, help="comma list of on,off (default: on,off; off in retention mode)")
    p.add_argument("--rates", type=_floats, default=c.rates, help="requests per second, comma list")
    p.add_argument("--duration", type=float, default=c.duration_s, help="seconds of arrivals per rate")
    p.add_argument("--num-adapters", type=int, default=w.num_adapters, help="registered adapters (sweep mode)")
    p.add_argument("--retention-counts", type=_ints, default=c.retention_counts, help="comma list")
    p.add_argument("--zipf", type=float, default=w.zipf_s, help="Zipf exponent of adapter popularity")
    p.add_argument("--system-tokens", type=_pair, default=w.system_tokens, help="LOW,HIGH per tenant")
    p.add_argument("--turns", type=_pair, default=w.turns, help="LOW,HIGH per conversation")
    p.add_argument("--prompt-mean", type=float, default=w.prompt_mean_tokens, help="user message mean tokens")
    p.add_argument("--answer-mean", type=float, default=w.answer_mean_tokens, help="answer mean tokens")
    p.add_argument("--max-prompt", type=int, default=w.max_prompt_tokens, help="user message cap, tokens")
    p.add_argument("--max-answer", type=int, default=w.max_answer_tokens, help="answer cap, tokens")
    p.add_argument("--think", type=float, default=w.think_s, help="mean seconds between an answer and the next turn")
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--rank", type=int, default=c.rank)
    p.add_argument("--max-loras", type=int, default=c.max_loras)
    p.add_argument("--max-num-seqs", type=int, default=c.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=c.max_model_len)
    p.add_argument("--warmup-requests", type=int, default=c.warmup_requests)
    p.add_argument("--server-timeout", type=float, default=c.server_timeout_s, help="seconds to /ready")
    p.add_argument("--request-timeout", type=float, default=c.request_timeout_s, help="seconds per request")
    p.add_argument("--slo-ttft-ms", type=float, default=c.slo.ttft_p99_s * 1000, help="TTFT p99 bound")
    p.add_argument("--slo-tpot-ms", type=float, default=c.slo.tpot_p99_s * 1000, help="TPOT p99 bound")
    if preset == "smoke":
        p.set_defaults(**SMOKE)
    return p


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    is_retention = args.mode == "retention"
    kind = WorkloadKind(args.workload or ("uniform" if is_retention else "chat"))
    caches = tuple(v.strip() for v in (args.cache or ("off" if is_retention else "on,off")).split(",") if v.strip())
    workload = WorkloadConfig(kind=kind, num_adapters=args.num_adapters, zipf_s=args.zipf,
                              system_tokens=args.system_tokens, turns=args.turns, prompt_mean_tokens=args.prompt_mean,
                              answer_mean_tokens=args.answer_mean, max_prompt_tokens=args.max_prompt,
                              max_answer_tokens=args.max_answer, think_s=args.think, seed=args.seed)
    return ServeBenchConfig(mode=args.mode, workload=workload, rates=args.rates, duration_s=args.duration,
                            caches=caches, retention_counts=args.retention_counts, device=args.device,
                            shape=args.shape, model_dir=args.model_dir, rank=args.rank, max_loras=args.max_loras,
                            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                            server_timeout_s=args.server_timeout, request_timeout_s=args.request_timeout,
                            warmup_requests=args.warmup_requests,
                            slo=Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    preset = argparse.ArgumentParser(add_help=False)
    preset.add_argument("--preset")
    return build_parser(preset.parse_known_args(argv)[0].preset).parse_args(argv)


def _settings_lines(config: ServeBenchConfig, notes: list[str]) -> dict[str, str]:
    w = config.workload
    lines = {"command": f"mode {config.mode}, workload {w.kind.value}, rates {','.join(map(str, config.rates))} "
                        f"req/s, {config.duration_s:g} s of arrivals each",
             "workload": f"Zipf({w.zipf_s:g}) over the adapters, system prompt U{list(w.system_tokens)} tokens per "
                         f"tenant, U{list(w.turns)} turns, user message / answer lognormal means "
                         f"{w.prompt_mean_tokens:g} / {w.answer_mean_tokens:g} tokens (caps {w.max_prompt_tokens} / "
                         f"{w.max_answer_tokens}), think time {w.think_s:g} s",
             "server": f"rank {config.rank} q/k/v/o adapters, max_loras {config.max_loras}, max_num_seqs "
                       f"{config.max_num_seqs}, max_model_len {config.max_model_len}"}
    return lines | {f"note {i + 1}": note for i, note in enumerate(notes)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        return refuse("serve", exc)
    from kubelora.bench.engine_device import environment

    start = time.perf_counter()
    with work_folder("serve", args.workdir) as workdir:
        rows, notes = run(config, workdir)
    rows = merge_rows(args.rows, rows)
    env = environment(config.device) | {"seconds": f"{time.perf_counter() - start:.0f}"}
    publish(render_markdown(rows, env, _settings_lines(config, notes), config.slo), args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
