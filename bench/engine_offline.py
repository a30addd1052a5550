"""Timed runs of the offline engine: one workload through `LLM.engine`'s own step loop, repeated.

A run adds every request at once (as the waiting queue has room), then calls `engine.step()` until all have
finished, timing each call. Decode ms/step is the median wall time of the steps after every request has its
first token (each step returns the sampled ids, so its wall time is the engine's whole step); tokens/s is
tokens generated over the run's wall time; TTFT is each request's first_token_time - arrival_time.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch

from kubelora.bench.engine_device import kernel_split, sync


@dataclass(frozen=True)
class Workload:
    """The same requests for every repeat: prompt ids, adapter per request (None: base), tokens each."""

    prompts: list[list[int]]
    adapters: list[str | None]
    max_tokens: int
    structured: tuple | None = None  # per request: a StructuredOutput constraining it, or None

    def with_max_tokens(self, max_tokens: int) -> Workload:
        return Workload(self.prompts, self.adapters, max_tokens, self.structured)


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random ids past the tokenizer's special tokens (the first few ids)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (num, length), generator=generator).tolist()


def round_robin(names: list[str], num: int) -> list[str | None]:
    return [names[i % len(names)] for i in range(num)] if names else [None] * num


@dataclass
class RunStats:
    seconds: float
    num_tokens: int
    decode_ms: float | None  # median decode step; None when no step was decode-only
    num_steps: int
    ttft_s: list[float] = field(repr=False)
    max_batch: int = 0  # most sequences in one step (only tracked when asked)
    max_adapters: int = 0  # most distinct adapters in one step (likewise)
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # generated ids, in request order

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "num_tokens": self.num_tokens, "decode_ms": self.decode_ms,
                "num_steps": self.num_steps, "tokens_per_s": self.tokens_per_s, "ttft_p50_s": percentile(self.ttft_s, 50),
                "ttft_p99_s": percentile(self.ttft_s, 99), "max_batch": self.max_batch,
                "max_adapters": self.max_adapters}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class _Profile:
    """A torch.profiler window over `num_steps` decode steps, opened after `skip` of them."""

    num_steps: int
    skip: int = 3
    profiler: object = None
    wall_s: float = 0.0
    done: int = 0
    result: dict | None = None


def run_workload(llm, workload: Workload, device: str, is_tracked: bool = False,
                 profile: _Profile | None = None) -> RunStats:
    """One pass of the workload through the engine's step loop."""
    from kubelora.engine import SamplingParams

    params = [SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True, structured=spec)
              for spec in (workload.structured or [None] * len(workload.prompts))]
    llm.capture_graphs()  # as LLM.generate does first
    engine = llm.engine
    order = [f"r{i}-{time.monotonic_ns()}" for i in range(len(workload.prompts))]
    pending = list(zip(order, workload.prompts, workload.adapters, params))[::-1]
    finals, first_seen, decode_ms = {}, set(), []
    stats = RunStats(0.0, 0, None, 0, [])
    sync(device)
    start = time.perf_counter()
    while pending or len(finals) < len(order):
        while pending and engine.has_waiting_room():
            _add(engine, pending.pop())
        is_decode = not pending and len(first_seen) == len(order)
        if is_decode and profile is not None:
            _profile_step(profile, device)
        began = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - began
        if is_decode and outputs:
            decode_ms.append(1e3 * elapsed)
            if profile is not None and profile.profiler is not None:
                profile.wall_s += elapsed
        stats.num_steps += 1
        _record(outputs, first_seen, finals)
        if is_tracked:
            _track(stats, engine.snapshot())
    sync(device)
    stats.seconds = time.perf_counter() - start
    if profile is not None:
        _close_profile(profile, device)
    _check_finished(finals)
    stats.outputs = [list(finals[request_id].token_ids) for request_id in order]
    stats.num_tokens = sum(len(ids) for ids in stats.outputs)
    stats.ttft_s = [o.first_token_time - o.arrival_time for o in finals.values() if o.first_token_time]
    stats.decode_ms = statistics.median(decode_ms) if decode_ms else None
    return stats


def _add(engine, request: tuple) -> None:
    request_id, prompt, adapter, params = request
    engine.add_request(request_id, prompt, params, adapter)


def _record(outputs: list, first_seen: set[str], finals: dict) -> None:
    for out in outputs:
        if out.token_ids:
            first_seen.add(out.request_id)
        if out.finished:
            finals[out.request_id] = out


def _track(stats: RunStats, snapshot) -> None:
    stats.max_batch = max(stats.max_batch, snapshot.last_batch_size)
    stats.max_adapters = max(stats.max_adapters, snapshot.last_batch_adapters)


def _check_finished(finals: dict) -> None:
    failed = [o for o in finals.values() if o.finish_reason not in ("length", "stop")]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].request_id}: {failed[0].finish_reason} "
                           f"{failed[0].error}")


def _profile_step(profile: _Profile, device: str) -> None:
    """Called before each decode step: opens the window after `skip` steps, closes it after `num_steps`."""
    if profile.skip > 0:
        profile.skip -= 1
        return
    if profile.profiler is None and profile.result is None:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        sync(device)
        profile.profiler = torch_profile(activities=activities)
        profile.profiler.__enter__()
        return
    if profile.profiler is not None:
        profile.done += 1
        if profile.done >= profile.num_steps:
            _close_profile(profile, device)


def _close_profile(profile: _Profile, device: str) -> None:
    if profile.profiler is None:
        return
    sync(device)
    with warnings.catch_warnings():  # "clears events at the end of each cycle": there is one cycle
        warnings.simplefilter("ignore", UserWarning)
        profile.profiler.__exit__(None, None, None)
    profile.result = kernel_split(profile.profiler, profile.wall_s, max(profile.done, 1))
    profile.profiler = None


@dataclass
class Row:
    """One result row: its timed repeats (after a warm-up) and what the warm-up saw."""

    key: str
    label: str
    runs: list[RunStats]
    warmup: RunStats | None = None
    extra: dict = field(default_factory=dict)

    def median(self, attribute: str) -> float | None:
        values = [v for v in (getattr(r, attribute) for r in self.runs) if v is not None]
        return statistics.median(values) if values else None

    def spread(self, attribute: str) -> tuple[float, float] | None:
        values = [v for v in (getattr(r, attribute) for r in self.runs) if v is not None]
        return (min(values), max(values)) if values else None

    def ttft(self, q: float) -> float | None:
        values = [percentile(r.ttft_s, q) for r in self.runs if r.ttft_s]
        return statistics.median(values) if values else None

    def as_dict(self) -> dict:
        return {"key": self.key, "label": self.label, "runs": [r.as_dict() for r in self.runs],
                "warmup": self.warmup.as_dict() if self.warmup else None, **self.extra}


def time_row(llm, key: str, label: str, workload: Workload, device: str, num_repeats: int, warmup_tokens: int,
             is_tracked: bool = False, profile_steps: int = 0) -> Row:
    """A warm-up pass (warmup_tokens each: kernels compiled, adapters resident), then the timed repeats."""
    warmup = run_workload(llm, workload.with_max_tokens(min(warmup_tokens, workload.max_tokens)), device,
                          is_tracked=True)
    runs = [run_workload(llm, workload, device, is_tracked=is_tracked) for _ in range(num_repeats)]
    row = Row(key, label, runs, warmup)
    if profile_steps:
        # Skip the first decode steps when the run has room for them (decode steps: max_tokens - 1).
        profile = _Profile(profile_steps, skip=min(3, max(0, workload.max_tokens - 2 - profile_steps)))
        run_workload(llm, workload, device, profile=profile)
        row.extra["profile"] = profile.result
    steps = ", ".join(f"{r.seconds:.2f} s" + (f" / {r.decode_ms:.2f} ms" if r.decode_ms else "") for r in runs)
    print(f"  {label}: {steps}", flush=True)
    return row
