"""The operator benchmark's phases, and what is read around each: CPU clocks of every process, the operator's
memory and metrics (passes, their summed duration), the fakes' call counts.

Phases, in order, on a running fleet (operator.py sets it up):
- `fill`: the fleet's adapters created at once (a GitOps sync), until every one is Ready;
- `steady`: nothing changes for a while: what a converged fleet costs (resync passes only);
- `singles`: one adapter at a time into the steady fleet, each once the passes its previous one caused have ended
  (`wait_quiet`); its time is from its create request to the watch event that shows it Ready;
- `bulk-apply` / `bulk-delete`: many adapters created, then deleted, at once; until every one is Ready, or gone.

Times come from this process's clock: just before a create (or delete) request is sent, and on the arrival of the
watch event that shows the adapter Ready (or deleted). Status conditions carry one-second timestamps only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass

from kubelora.bench.operator_fleet import Memory, OperatorCounters, cpu_seconds, memory, read_fake_counts, \
    read_held, read_operator_metrics, read_requests
from kubelora.bench.operator_kube import AdapterWatch, create_adapters, delete_adapters
from kubelora.operator.kube import Kube


@dataclass(frozen=True)
class Calls:
    """What the fakes saw in one phase. Pairs: (pod, adapter) over every pod and the phase's own adapters, by the
    load and unload calls each got."""
    lists: dict[str, int]  # pod -> plain GET /v1/models (a pass's observation; long polls are apart)
    watches: int  # long polls (GET /v1/models?changed_since=) started
    preloads: int
    registrations: int  # loads with preload: false
    unloads: int
    key_pushes: int
    pairs_once: int
    pairs_repeated: int  # more than one call
    pairs_missing: int  # none
    other_calls: int  # loads and unloads of adapters outside the phase's own

    @property
    def engine_calls(self) -> int:
        return self.preloads + self.registrations + self.unloads


def count_calls(before: Mapping[str, dict], after: Mapping[str, dict], pods: Mapping[str, str],
                subject: Collection[str]) -> Calls:
    """before, after: the fakes' counts by pod IP; pods: pod IP -> pod name; subject: the phase's adapters."""
    subject = set(subject)
    lists, totals, pairs = {}, dict.fromkeys(("watch", "preloads", "registrations", "unloads", "put_keys"), 0), []
    other = 0
    for ip, name in pods.items():
        old, new = before.get(ip) or {}, after[ip]
        lists[name] = _diff(old.get("requests"), new["requests"], "list")
        totals["watch"] += _diff(old.get("requests"), new["requests"], "watch")
        totals["put_keys"] += _diff(old.get("requests"), new["requests"], "put_keys")
        per_adapter: dict[str, int] = {}
        for kind in ("preloads", "registrations", "unloads"):
            for adapter, count in new[kind].items():
                delta = count - (old.get(kind) or {}).get(adapter, 0)
                totals[kind] += delta
                per_adapter[adapter] = per_adapter.get(adapter, 0) + delta
        other += sum(n for adapter, n in per_adapter.items() if adapter not in subject)
        pairs += [per_adapter.get(adapter, 0) for adapter in subject]
    return Calls(lists, totals["watch"], totals["preloads"], totals["registrations"], totals["unloads"],
                 totals["put_keys"], sum(1 for n in pairs if n == 1), sum(1 for n in pairs if n > 1),
                 sum(1 for n in pairs if n == 0), other)


def _diff(old: Mapping[str, int] | None, new: Mapping[str, int], key: str) -> int:
    return new.get(key, 0) - (old or {}).get(key, 0)


@dataclass(frozen=True)
class Reading:
    """Everything read at one instant."""
    at: float  # time.monotonic()
    cpu_s: dict[str, float]  # process name -> CPU seconds so far
    counters: OperatorCounters
    counts: dict[str, dict]  # the fakes' counts by pod IP
    operator_memory: Memory


@dataclass(frozen=True)
class PhaseResult:
    name: str
    num_adapters: int  # the phase's own adapters (created, or deleted)
    wall_s: float  # the phase's action: its requests sent until every adapter was Ready (or gone)
    window_s: float  # the readings' window: the action and the wait for quiet after it (its last passes end in it)
    cpu_s: dict[str, float]  # process name -> CPU seconds in the window
    operator_memory: Memory  # at its end
    passes: int
    whole_passes: int  # of `passes`, those that read every adapter and model list
    pass_seconds: float  # the passes' durations summed
    operator_calls: int  # loads and unloads by the operator's metrics (errors included)
    call_errors: int
    calls: Calls
    times_s: tuple[float, ...] = ()  # per adapter: request sent -> Ready (or deleted) seen
    all_done_s: float | None = None  # the first request sent -> the last adapter Ready (or deleted)
    all_unloaded_s: float | None = None  # deletes: the first request sent -> no pod holds any of them


@dataclass
class Fleet:
    """A running fleet, as the phases use it."""
    kube: Kube
    namespace: str
    watch: AdapterWatch
    pods: dict[str, str]  # engine pod IP -> pod name
    pids: dict[str, int]  # process name -> pid (operator, kube-apiserver, etcd, fake-engines, router-0, ...)
    metrics_port: int
    control_port: int
    admin_token: str  # the engines' (operator_anatomy.py calls them as the operator does)
    create_concurrency: int
    timeout_s: float

    async def read(self) -> Reading:
        counters = await asyncio.to_thread(read_operator_metrics, self.metrics_port)
        counts = await asyncio.to_thread(read_fake_counts, self.control_port)
        return Reading(time.monotonic(), cpu_seconds(self.pids), counters, counts, memory(self.pids["operator"]))


@dataclass(frozen=True)
class Outcome:
    """What a phase's action measured."""
    times_s: tuple[float, ...] = ()
    all_done_s: float | None = None
    all_unloaded_s: float | None = None


QUIET_POLL_S = 0.25


async def wait_quiet(fleet: Fleet, quiet_s: float) -> None:
    """Until the operator has ended no pass, and the fakes have seen no model list, load or unload, for `quiet_s`:
    the passes an action caused (its own loads wake the long polls for one more) have ended. A pass lists every pod
    first and ends with its status writes, so with `quiet_s` longer than a pass none is left half done."""
    def activity(counters: OperatorCounters, requests: dict[str, dict[str, int]]) -> tuple:
        return counters.passes, sum(r.get(k, 0) for r in requests.values() for k in ("list", "load", "unload"))

    deadline = time.monotonic() + fleet.timeout_s
    last, since = None, time.monotonic()
    while True:
        now = activity(await asyncio.to_thread(read_operator_metrics, fleet.metrics_port),
                       await asyncio.to_thread(read_requests, fleet.control_port))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the operator did not go quiet for {quiet_s:g} s within {fleet.timeout_s:g} s")
        await asyncio.sleep(QUIET_POLL_S)


async def run_phase(fleet: Fleet, name: str, subject: Collection[str], act: Callable[[], Awaitable[Outcome]],
                    quiet_s: float) -> PhaseResult:
    """Readings before `act()` and once the operator is quiet after it (`wait_quiet`): the passes the action caused
    end inside the window."""
    before = await fleet.read()
    outcome = await act()
    acted = time.monotonic()
    await wait_quiet(fleet, quiet_s)
    after = await fleet.read()
    cpu = {proc: after.cpu_s[proc] - before.cpu_s.get(proc, 0.0) for proc in after.cpu_s}
    counters = [after.counters, before.counters]
    return PhaseResult(name, len(subject), acted - before.at, after.at - before.at, cpu, after.operator_memory,
                       round(counters[0].passes - counters[1].passes),
                       round(counters[0].whole_passes - counters[1].whole_passes),
                       counters[0].pass_seconds - counters[1].pass_seconds,
                       round(counters[0].loads + counters[0].unloads - counters[1].loads - counters[1].unloads),
                       round(counters[0].call_errors - counters[1].call_errors),
                       count_calls(before.counts, after.counts, fleet.pods, subject), outcome.times_s,
                       outcome.all_done_s, outcome.all_unloaded_s)


async def apply_all(fleet: Fleet, bodies: list[dict]) -> Outcome:
    """Create every adapter at once; wait until each is Ready."""
    sent = await create_adapters(fleet.kube, fleet.namespace, bodies, fleet.create_concurrency)
    await fleet.watch.wait_ready(sent, fleet.timeout_s)
    ready = {name: fleet.watch.ready_at[name] for name in sent}
    return Outcome(tuple(ready[n] - sent[n] for n in sent), max(ready.values()) - min(sent.values()))


async def delete_all(fleet: Fleet, adapter_names: list[str], prefix: str) -> Outcome:
    """Delete every adapter at once (all named `prefix`...); wait until each is gone from the API server and no
    fake holds any of them. An adapter's finalizer may go before its unloads (the deletion handler waits for the
    reconcile only so long, docs/operator.md): both times are reported."""
    sent = await delete_adapters(fleet.kube, fleet.namespace, adapter_names, fleet.create_concurrency)
    await fleet.watch.wait_deleted(sent, fleet.timeout_s)
    gone = {name: fleet.watch.deleted_at[name] for name in sent}
    deadline = time.monotonic() + fleet.timeout_s
    while sum((await asyncio.to_thread(read_held, fleet.control_port, prefix)).values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fakes still hold adapters named {prefix}... {fleet.timeout_s:g} s on")
        await asyncio.sleep(0.25)
    unloaded = time.monotonic()
    first = min(sent.values())
    return Outcome(tuple(gone[n] - sent[n] for n in sent), max(gone.values()) - first, unloaded - first)


async def apply_one_by_one(fleet: Fleet, bodies: list[dict], quiet_s: float) -> Outcome:
    """Each adapter once the operator has been quiet for `quiet_s` (a steady fleet), then until it is Ready."""
    times: list[float] = []
    for body in bodies:
        await wait_quiet(fleet, quiet_s)
        times += (await apply_all(fleet, [body])).times_s
    return Outcome(tuple(times))


async def stay(seconds: float) -> Outcome:
    await asyncio.sleep(seconds)
    return Outcome()
