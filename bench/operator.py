"""The operator at fleet scale against a real API server: `kubelora operator` driving engine pods stood in by fakes.

    kubelora bench operator [--replicas 16] [--adapters 2000] [--bulk 500] [--singles 10] [--routers 1]
        [--copies 1] [--steady-seconds 65] [--resync-seconds S] [--small] [--write docs/benchmarks-operator.md]

The bench starts its own etcd and kube-apiserver (operator_cluster.py), applies the CRDs, and runs the operator as
its CLI runs it, watching one namespace. A LoRAPool of --replicas engine pods, with a router when --routers > 0:
the bench makes the pods from the Deployments the operator applied (no controller-manager or kubelet runs) and marks
them Ready on loopback addresses, where fake engines (operator_engines.py: the engine's own admin HTTP layer over
a stand-in adapter manager; a test double) and real `kubelora router` processes listen (operator_fleet.py). Then the
phases of operator_measure.py: --adapters at once, a steady while, --singles one by one, --bulk at once, the
same --bulk deleted at once.

Targets (issue 41, "Fleet"): one adapter applied into a steady fleet Ready at p50 <= 1 s; a bulk apply all Ready
within a reported time; steady, one GET per pod per pass; a bulk change costs one engine call per adapter and pod;
the operator's CPU and memory reported. --small is a preset a CPU test runs in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kubelora.bench import operator_fleet as procs
from kubelora.bench.operator_cluster import ControlPlane, free_port, start_control_plane
from kubelora.bench.operator_engines import FakeFleetConfig
from kubelora.bench.operator_kube import AdapterWatch, create_namespace, create_pool, get_pool, make_pods, mark_ready, \
    wait_for_object
from kubelora.bench.operator_measure import Fleet, PhaseResult, apply_all, apply_one_by_one, delete_all, run_phase, \
    stay
from kubelora.operator import names
from kubelora.operator.kube import Kube
from kubelora.operator.placement import BALANCE_FACTOR

NAMESPACE = "bench"
POOL = "fleet"
ENGINE_IP = "127.0.10.{}"  # pod i listens on 127.0.10.(i+1): every fake on the engine's fixed ports
ROUTER_IP = "127.0.20.{}"
MAX_PODS = 254  # one loopback /24 each
SETUP_TIMEOUT_S = 120.0


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
    settle_s: float = 3.0  # quiet before each single
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
    setup_s: float  # control plane up to the pool Ready with no adapters
    operator_peak_rss_bytes: int
    note: str = ""


def adapter_names(prefix: str, count: int) -> list[str]:
    width = len(str(count - 1))
    return [f"{prefix}-{i:0{width}d}" for i in range(count)]


def adapter_body(name: str, root: Path, copies: int) -> dict:
    return {"apiVersion": names.API_VERSION, "kind": "LoRAAdapter", "metadata": {"name": name},
            "spec": {"pool": POOL, "source": {"path": str(root / name)}, "replicas": copies}}


def pool_body(config: OperatorBenchConfig, root: Path) -> dict:
    router = {"enabled": config.num_routers > 0, "replicas": max(config.num_routers, 1)}
    return {"apiVersion": names.API_VERSION, "kind": "LoRAPool", "metadata": {"name": POOL}, "spec": {
        "model": {"path": "/models/bench", "servedName": "bench-base"}, "replicas": config.num_replicas,
        "adapterRoots": [str(root)], "router": router,
        "engine": {"maxLoras": config.max_loras, "maxLoraRank": config.max_lora_rank,
                   "maxCpuLoras": config.max_cpu_loras}}}


@dataclass
class Running:
    """What `start_fleet` started, for the phases and for stopping."""
    plane: ControlPlane
    processes: dict[str, object]  # name -> subprocess.Popen
    fleet: Fleet | None = None


async def start_fleet(config: OperatorBenchConfig, running: Running, kube: Kube, workdir: Path) -> Fleet:
    """Namespace, pool, operator, engine pods with their fakes, router pods with their routers; returns once the pool
    is Ready with every engine and router."""
    plane, logs = running.plane, workdir / "logs"
    logs.mkdir(exist_ok=True)
    await create_namespace(kube, NAMESPACE)
    metrics_port, control_port = free_port(), free_port()
    running.processes["operator"] = await asyncio.to_thread(
        procs.start_operator, plane.kubeconfig, NAMESPACE, metrics_port, config.resync_s, logs / "operator.log")
    await create_pool(kube, NAMESPACE, pool_body(config, workdir / "adapters"))
    engines = await wait_for_object(kube, "Deployment", NAMESPACE, names.engine_name(POOL), SETUP_TIMEOUT_S)
    secret = names.admin_token_secret_name(POOL)
    await wait_for_object(kube, "Secret", NAMESPACE, secret, SETUP_TIMEOUT_S)
    token = await kube.read_secret_key(NAMESPACE, secret, names.ADMIN_TOKEN_KEY)
    container = engines["spec"]["template"]["spec"]["containers"][0]
    ips = [ENGINE_IP.format(i + 1) for i in range(config.num_replicas)]
    fakes = FakeFleetConfig(tuple(ips), tuple(container["args"][2:]), {"KUBELORA_ADMIN_TOKEN": token}, config.rank,
                            control_port)
    fakes_process = running.processes["fake-engines"] = procs.start_fakes(fakes, workdir, logs / "fake-engines.log")
    routers = await start_routers(config, running, kube, logs)  # their processes start beside the fakes
    await asyncio.to_thread(procs.wait_listening, fakes_process, logs / "fake-engines.log")
    pods = await make_pods(kube, NAMESPACE, engines, config.num_replicas)
    for pod, ip in zip(pods, ips):
        await mark_ready(kube, NAMESPACE, pod, ip, [container])
    for name, (pod, ip, container) in routers.items():  # ready once it has read the first placement
        await asyncio.to_thread(procs.wait_router_ready, ip, names.ROUTER_PORT, running.processes[name],
                                logs / f"{name}.log")
        await mark_ready(kube, NAMESPACE, pod, ip, [container])
    await wait_pool_ready(kube, config)
    pids = {name: p.pid for name, p in running.processes.items()} | plane.cpu_pids()
    return Fleet(kube, NAMESPACE, AdapterWatch(NAMESPACE), dict(zip(ips, pods)), pids, metrics_port, control_port,
                 config.create_concurrency, config.timeout_s)


async def start_routers(config: OperatorBenchConfig, running: Running, kube: Kube,
                        logs: Path) -> dict[str, tuple[str, str, dict]]:
    """The router pods and their processes (`router-J` in `running.processes`), started, not yet ready:
    process name -> (its pod, the pod's IP, its container)."""
    if not config.num_routers:
        return {}
    deployment = await wait_for_object(kube, "Deployment", NAMESPACE, names.router_name(POOL), SETUP_TIMEOUT_S)
    await wait_for_object(kube, "ServiceAccount", NAMESPACE, names.router_name(POOL), SETUP_TIMEOUT_S)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    routers = {}
    for j, pod in enumerate(await make_pods(kube, NAMESPACE, deployment, config.num_routers)):
        name, ip = f"router-{j}", ROUTER_IP.format(j + 1)
        running.processes[name] = procs.start_router(running.plane.kubeconfig, container["args"], ip,
                                                     logs / f"{name}.log")
        routers[name] = (pod, ip, container)
    return routers


async def wait_pool_ready(kube: Kube, config: OperatorBenchConfig) -> None:
    """Until the pool's status has every engine ready, every router current and Ready=True."""
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while True:
        status = ((await get_pool(kube, NAMESPACE, POOL)) or {}).get("status") or {}
        routers = status.get("routers") or []
        is_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        if (is_ready and status.get("readyReplicas") == config.num_replicas and len(routers) == config.num_routers
                and all(r.get("revision", -1) >= 0 and not r.get("stale") for r in routers)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool did not turn Ready within {SETUP_TIMEOUT_S:g} s: status {status}")
        await asyncio.sleep(0.5)


async def run_phases(config: OperatorBenchConfig, fleet: Fleet, root: Path) -> list[PhaseResult]:
    def bodies(adapters: list[str]) -> list[dict]:
        return [adapter_body(name, root, config.copies) for name in adapters]

    steady, singles, bulk = (adapter_names(p, n) for p, n in (("fleet", config.num_adapters),
                                                             ("single", config.num_singles),
                                                             ("bulk", config.num_bulk)))
    settle_s = config.settle_s
    plan = (("fill", steady, lambda: apply_all(fleet, bodies(steady))),
            ("steady", (), lambda: stay(config.steady_s)),
            ("singles", singles, lambda: apply_one_by_one(fleet, bodies(singles), settle_s)),
            ("bulk-apply", bulk, lambda: apply_all(fleet, bodies(bulk))),
            ("bulk-delete", bulk, lambda: delete_all(fleet, bulk, "bulk-")))
    phases = []
    for name, subject, act in plan:
        phases.append(await run_phase(fleet, name, subject, act, settle_s))
        done, unloaded = phases[-1].all_done_s, phases[-1].all_unloaded_s
        print(f"  {name}: {phases[-1].wall_s:.1f} s" + ("" if done is None else f", all done in {done:.1f} s")
              + ("" if unloaded is None else f", unloaded everywhere in {unloaded:.1f} s"), flush=True)
    return phases


async def measure(config: OperatorBenchConfig, running: Running, workdir: Path) -> tuple[list[PhaseResult], float]:
    """(the phases, the setup's seconds)."""
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
            return await run_phases(config, fleet, root), setup_s
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
    running = Running(plane, {})
    load_before = os.getloadavg()[0]
    try:
        plane.install_crds()
        phases, setup_s = asyncio.run(measure(config, running, workdir))
        peak = procs.memory(running.processes["operator"].pid).peak_rss_bytes
        env = environment(plane)
    finally:
        procs.stop(*running.processes.values())
        plane.stop()
    env["load average (1 min) before / after"] = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    return OperatorReport(env, config, phases, setup_s, peak, note)


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
    p.add_argument("--settle-seconds", type=float, default=d.settle_s, help="quiet before each single")
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
        print(f"kubelora bench operator: {exc}", flush=True)
        return 2
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kubelora-bench-operator-")))
        workdir.mkdir(parents=True, exist_ok=True)
        report = run(config, workdir, args.note)
    text = render_markdown(report)
    print(text, flush=True)
    if args.write:
        Path(args.write).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
