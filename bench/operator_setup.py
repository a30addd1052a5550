"""The operator benchmark's fleet, set up: the namespace, the pool, the operator, the engine pods with their fakes
and the router pods with their routers, until the pool is Ready (operator.py runs the phases on it)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kubelora.bench import operator_fleet as procs
from kubelora.bench.operator_cluster import ControlPlane, free_port
from kubelora.bench.operator_engines import FakeFleetConfig
from kubelora.bench.operator_kube import AdapterWatch, create_namespace, create_pool, get_pool, make_pods, mark_ready, \
    wait_for_object
from kubelora.bench.operator_measure import Fleet
from kubelora.operator import names
from kubelora.operator.kube import Kube

if TYPE_CHECKING:
    from kubelora.bench.operator import OperatorBenchConfig

NAMESPACE = "bench"
POOL = "fleet"
SETUP_TIMEOUT_S = 120.0


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
    processes: dict[str, object] = field(default_factory=dict)  # name -> subprocess.Popen
    # The pods' loopback /24s, 127.A.B and 127.A.(B+1), drawn per run: engines listen on the engine's fixed ports,
    # so two runs on one machine must not share addresses.
    network: str = field(default_factory=lambda: _draw_network())
    fleet: Fleet | None = None

    @property
    def router_network(self) -> str:
        prefix, _, third = self.network.rpartition(".")
        return f"{prefix}.{int(third) + 1}"


def _draw_network() -> str:
    draw = random.SystemRandom()
    return f"127.{draw.randint(64, 254)}.{draw.randint(0, 253)}"


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
    ips = [f"{running.network}.{i + 1}" for i in range(config.num_replicas)]
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
                 token, config.create_concurrency, config.timeout_s)


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
        name, ip = f"router-{j}", f"{running.router_network}.{j + 1}"
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
