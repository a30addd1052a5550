"""The operator at fleet scale against a real API server: `kubelora operator` driving engine pods stood in by fakes.

    kubelora bench operator [--replicas 16] [--adapters 2000] [--bulk 500] [--singles 10] [--routers 1]
        [--copies 1] [--steady-seconds 65] [--settle-seconds 5] [--resync-seconds S] [--small]
        [--workdir DIR] [--write docs/benchmarks-operator.md]

The bench starts its own etcd and kube-apiserver (operator_cluster.py), applies the CRDs, and runs the operator as
its CLI runs it, watching one namespace. A LoRAPool of --replicas engine pods, with a router when --routers > 0
(operator_setup.py): the bench makes the pods from the Deployments the operator applied (no controller-manager or
kubelet runs) and marks them Ready on loopback addresses, where fake engines (operator_engines.py: the engine's own
admin HTTP layer over a stand-in adapter manager; a test double) and real `kubelora router` processes listen
(operator_fleet.py). Then the phases of operator_measure.py: --adapters at once, a steady while, --singles one by
one, --bulk at once, the same --bulk deleted at once; after the steady phase, one pass's parts are timed in this
process (operator_anatomy.py).

Targets: one adapter applied into a steady fleet Ready at p50 <= 1 s; a bulk apply all Ready within a reported
time; steady, one GET per pod per pass; a bulk change costs one engine call per adapter and pod; the operator's CPU
and memory reported. --small is a preset a CPU test runs in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kubelora.bench import operator_fleet as procs
from kubelora.bench.command import publish, refuse, work_folder
from kubelora.bench.operator_anatomy import PassAnatomy, time_pass
from kubelora.bench.operator_cluster import ControlPlane, start_control_plane
from kubelora.bench.operator_measure import Fleet, PhaseResult, apply_all, apply_one_by_one, delete_all, run_phase, \
    stay
from kubelora.bench.operator_setup import NAMESPACE, POOL, Running, adapter_body, adapter_names, start_fleet
from kubelora.operator.kube import Kube
from kubelora.operator.placement import BALANCE_FACTOR

MAX_PODS = 254  # engines and routers each get a loopback /24


@dataclass(frozen=True)
class OperatorBenchConfig:
    num_replicas: int = 16  # engine pods
    num_adapters: int = 2000  # the steady fleet
    num_bulk: int = 500  # created at once into it, then deleted at once
    num_singles: int = 10  # created one by one into it
    num_routers: int = 1  # router pods (real `kubelora router` processes); 0: the pool has none
    copies: int = 1  # each adapter's `replicas`
    rank: int = 8  # every fake adapter's rank
    max_loras: int = 128  # the pool's engine settings (the device pool's budget: max_loras x max_lora_rank rows)
    max_lora_rank: int = 16
    max_cpu_loras: int = 256
    steady_s: float = 65.0  # two passes at the operator's default resync (30 s)
    settle_s: float = 5.0  # the operator quiet this long (no pass ended, no engine call): a phase ends, a single starts
    resync_s: float | None = None  # None: the operator's default
    create_concurrency: int = 16  # the bench's requests in flight to the API server
    timeout_s: float = 1800.0  # a phase's wait

    def __post_init__(self) -> None:
        for name in ("num_replicas", "num_adapters", "num_bulk", "num_singles", "copies", "rank", "max_loras",
                     "max_lora_rank", "max_cpu_loras", "create_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"OperatorBenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_replicas > MAX_PODS or not 0 <= self.num_routers <= MAX_PODS:
            raise ValueError(f"OperatorBenchConfig.num_replicas must be in [1, {MAX_PODS}] and num_routers in "
                             f"[0, {MAX_PODS}], got {self.num_replicas} and {self.num_routers}")
        if self.copies > self.num_replicas:
            raise ValueError(f"OperatorBenchConfig.copies must be <= num_replicas ({self.num_replicas}), got "
                             f"{self.copies}")
        if self.rank > self.max_lora_rank:
            raise ValueError(f"OperatorBenchConfig.rank must be <= max_lora_rank ({self.max_lora_rank}), got "
                             f"{self.rank}")
        if self.per_pod_bound > min(self.max_cpu_loras, self.max_loras * self.max_lora_rank // self.rank):
            raise ValueError(f"the pods cannot hold the adapters: up to {self.per_pod_bound} placed per pod, room "
                             f"for max_cpu_loras={self.max_cpu_loras} and {self.max_loras * self.max_lora_rank // self.rank} "
                             f"rank-{self.rank} adapters in the device pool; raise max_cpu_loras or max_loras")
        if self.steady_s < 0 or self.settle_s < 0 or self.timeout_s <= 0:
            raise ValueError("OperatorBenchConfig.steady_s and settle_s must be >= 0 and timeout_s > 0")

    @property
    def per_pod_bound(self) -> int:
        """Placed adapters per pod at the largest fleet, at the placement's balance bound."""
        total = (self.num_adapters + self.num_singles + self.num_bulk) * self.copies
        return math.ceil(BALANCE_FACTOR * total / self.num_replicas)


SMALL = OperatorBenchConfig(num_replicas=2, num_adapters=20, num_bulk=10, num_singles=3, copies=1, steady_s=6.0,
                            settle_s=1.0, resync_s=5.0, timeout_s=60.0)


@dataclass(frozen=True)
class OperatorReport:
    env: dict[str, str]
    config: OperatorBenchConfig
    phases: list[PhaseResult]
    anatomy: PassAnatomy  # one pass's reading and deciding, timed in the bench's process on the steady fleet
    setup_s: float  # control plane up to the pool Ready with no adapters
    operator_peak_rss_bytes: int
    note: str = ""


async def run_phases(config: OperatorBenchConfig, fleet: Fleet, session: aiohttp.ClientSession,
                     root: Path) -> tuple[list[PhaseResult], PassAnatomy]:
    def bodies(adapters: list[str]) -> list[dict]:
        return [adapter_body(name, root, config.copies) for name in adapters]

    steady, singles, bulk = (adapter_names(p, n) for p, n in (("fleet", config.num_adapters),
                                                             ("single", config.num_singles),
                                                             ("bulk", config.num_bulk)))
    settle_s, phases, anatomy = config.settle_s, [], None
    plan = (("fill", steady, lambda: apply_all(fleet, bodies(steady))),
            ("steady", (), lambda: stay(config.steady_s)),
            ("singles", singles, lambda: apply_one_by_one(fleet, bodies(singles), settle_s)),
            ("bulk-apply", bulk, lambda: apply_all(fleet, bodies(bulk))),
            ("bulk-delete", bulk, lambda: delete_all(fleet, bulk, "bulk-")))
    for name, subject, act in plan:
        phases.append(await run_phase(fleet, name, subject, act, settle_s))
        done, unloaded = phases[-1].all_done_s, phases[-1].all_unloaded_s
        print(f"  {name}: {phases[-1].wall_s:.1f} s" + ("" if done is None else f", all done in {done:.1f} s")
              + ("" if unloaded is None else f", unloaded everywhere in {unloaded:.1f} s"), flush=True)
        if name == "steady":  # the steady fleet, between the operator's resyncs
            anatomy = await time_pass(fleet.kube, session, NAMESPACE, POOL, fleet.admin_token)
    return phases, anatomy


async def measure(config: OperatorBenchConfig, running: Running,
                  workdir: Path) -> tuple[list[PhaseResult], PassAnatomy, float]:
    """(the phases, one pass's parts, the setup's seconds)."""
    root = workdir / "adapters"
    for prefix, count in (("fleet", config.num_adapters), ("single", config.num_singles), ("bulk", config.num_bulk)):
        for name in adapter_names(prefix, count):
            (root / name).mkdir(parents=True, exist_ok=True)  # an (empty) adapter directory: the fakes' loads confine it
    started = time.monotonic()
    connection = running.plane.connection()
    async with aiohttp.ClientSession(read_bufsize=1 << 22, connector=aiohttp.TCPConnector(limit=64)) as session:
        kube = Kube(connection, session, timeout_s=120.0)
        fleet = running.fleet = await start_fleet(config, running, kube, workdir)
        setup_s = time.monotonic() - started
        watching = asyncio.create_task(fleet.watch.run(session, connection))
        try:
            return (*await run_phases(config, fleet, session, root), setup_s)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching


def environment(plane: ControlPlane) -> dict[str, str]:
    import kopf

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    return {"cpu": f"{model}, {os.cpu_count()} cores (every process of the bench shares them)",
            "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
            "kube-apiserver / etcd": f"{plane.kube_version} (e2e/localcluster's build)",
            "python": platform.python_version(), "kopf": kopf.__version__, "aiohttp": aiohttp.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def run(config: OperatorBenchConfig, workdir: Path, note: str = "") -> OperatorReport:
    plane = start_control_plane(workdir / "cluster")
    running = Running(plane)
    load_before = os.getloadavg()[0]
    try:
        plane.install_crds()
        phases, anatomy, setup_s = asyncio.run(measure(config, running, workdir))
        peak = procs.memory(running.processes["operator"].pid).peak_rss_bytes
        env = environment(plane)
    finally:
        procs.stop(*running.processes.values())
        plane.stop()
    env["load average (1 min) before / after"] = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    return OperatorReport(env, config, phases, anatomy, setup_s, peak, note)


def build_parser() -> argparse.ArgumentParser:
    d = OperatorBenchConfig()
    p = argparse.ArgumentParser(prog="kubelora bench operator", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=d.num_replicas, help="engine pods (fake engines)")
    p.add_argument("--adapters", type=int, default=d.num_adapters, help="adapters of the steady fleet")
    p.add_argument("--bulk", type=int, default=d.num_bulk, help="adapters created, then deleted, at once")
    p.add_argument("--singles", type=int, default=d.num_singles, help="adapters created one by one")
    p.add_argument("--routers", type=int, default=d.num_routers, help="router pods (0: none)")
    p.add_argument("--copies", type=int, default=d.copies, help="each adapter's replicas")
    p.add_argument("--steady-seconds", type=float, default=d.steady_s)
    p.add_argument("--settle-seconds", type=float, default=d.settle_s,
                   help="the operator quiet this long (longer than a pass) ends a phase and comes before each single")
    p.add_argument("--resync-seconds", type=float, default=None, help="the operator's (default: its own, 30 s)")
    p.add_argument("--small", action="store_true", help="the CPU test's preset: 2 replicas x 20 adapters, bulk 10, "
                   "3 singles, resync 5 s, steady 6 s (other size flags are ignored)")
    p.add_argument("--workdir", default=None, help="keep the control plane's state and the logs here")
    p.add_argument("--write", default=None, help="write the markdown report to this path")
    p.add_argument("--note", default="", help="a paragraph printed above the tables")
    return p


def config_from_args(args: argparse.Namespace) -> OperatorBenchConfig:
    if args.small:
        return SMALL
    return dataclasses.replace(OperatorBenchConfig(), num_replicas=args.replicas, num_adapters=args.adapters,
                               num_bulk=args.bulk, num_singles=args.singles, num_routers=args.routers,
                               copies=args.copies, steady_s=args.steady_seconds, settle_s=args.settle_seconds,
                               resync_s=args.resync_seconds)


def main(argv: list[str] | None = None) -> int:
    from kubelora.bench.operator_report import render_markdown

    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        return refuse("operator", exc)
    with work_folder("operator", args.workdir) as workdir:
        report = run(config, workdir, args.note)
    publish(render_markdown(report), args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
