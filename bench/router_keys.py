"""What tenant API keys cost the router: its CPU per request and the latency it adds, keys on against off.

    kubelora bench router-keys [--keys 1000] [--granted 4] [--requests 200] [--concurrency 16] [--repeats 8]
        [--write docs/benchmarks-router-keys.md]

One fake engine (an aiohttp process answering a fixed JSON completion at once) and four `kubelora router
--placement-file` processes in front of it, one per arm: `open` (no apiKeys), `open-control` (the same again: how
far two identical routers differ here), `keys` (a table of --keys keys, each granted --granted adapters) and
`keys+limits` (the same table with request and token rates on every key, high enough never to refuse). The floor
arm, `engine`, sends the same requests straight to the engine.

A keep-alive aiohttp client sends completions, one at a time (sequential) and from --concurrency clients at once
(concurrent), with one key's `Authorization` header in every arm (an OpenAI SDK always sends one), rotating over
that key's adapters. The arms take turns request by request, so each has the same share of the same seconds of a
shared machine. A block is --requests requests per arm; around it each router's CPU clock (all its threads, ns) is
read. Between blocks the routers swap arms (each is handed another placement), and a repeat is one block per
router role, so every process has played every arm: two identical router processes differ by several percent in
CPU per request here, more than the 2% target.

Beside that, the key path alone (`KeyTable.authorize`, `check`, `KeyLimits.admit_request` as `handle_inference`
calls them) is timed in this process, with its code and data warm in the caches: a floor under what the keys cost.
Targets: router CPU keys on / off <= 1.02, p99 added latency (keys on minus off) <= 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kubelora.bench.command import publish, refuse, work_folder
from kubelora.bench.router_keys_fleet import Fleet, hand_out, process_cpu_s, start_fleet
from kubelora.bench.router_keys_report import render_markdown
from kubelora.contract.keys import KeyGrant, build_table, check_model, key_digest

ROUTER_ARMS = ("open", "open-control", "keys", "keys+limits")
ARMS = ("engine", *ROUTER_ARMS)  # engine: the floor, no router
NUM_KEY_PATH_ROUNDS = 5  # the key path's in-process time is the fastest round's
NUM_SWAP_WARMUP = 10  # requests per arm after the routers swap arms, before the block is measured
VARIANTS = ("sequential", "concurrent")
NEVER_REFUSING_RPM = 10**9  # a rate is checked on every request whatever its value; these never refuse
NEVER_REFUSING_TPM = 10**12


@dataclass(frozen=True)
class RouterKeysConfig:
    num_keys: int = 1000  # keys in the table
    num_granted: int = 4  # adapters each key may call
    num_requests: int = 200  # per arm and block (a repeat is one block per router arm)
    concurrency: int = 16  # clients of the concurrent variant
    num_repeats: int = 8
    num_warmup: int = 200  # per arm, before the first repeat
    num_key_path_calls: int = 20000
    startup_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_granted", "num_requests", "concurrency", "num_repeats", "num_key_path_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterKeysConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_warmup < 0:
            raise ValueError(f"RouterKeysConfig.num_warmup must be >= 0, got {self.num_warmup}")


@dataclass(frozen=True)
class ArmSample:
    """One arm's requests in one repeat of one variant: each request's seconds, the router's CPU seconds."""
    arm: str
    variant: str
    repeat: int
    latencies_s: tuple[float, ...]
    router_cpu_s: float | None  # None for the engine arm (no router)


@dataclass(frozen=True)
class RouterKeysReport:
    env: dict[str, str]
    config: RouterKeysConfig
    samples: list[ArmSample]
    key_path_us: dict[str, float]  # arm -> microseconds of the key path per request, timed in-process
    note: str = ""


@dataclass(frozen=True)
class Caller:
    key: str
    models: tuple[str, ...]


def build_grants(config: RouterKeysConfig, has_limits: bool, keys: list[str]) -> list[KeyGrant]:
    rpm, tpm = (NEVER_REFUSING_RPM, NEVER_REFUSING_TPM) if has_limits else (None, None)
    return [KeyGrant(key_digest(key), frozenset(adapter_names(i, config.num_granted)), False, rpm, tpm)
            for i, key in enumerate(keys)]


def adapter_names(key_index: int, num_granted: int) -> list[str]:
    return [f"tenant-{key_index:05d}-{j}" for j in range(num_granted)]


def placement(config: RouterKeysConfig, arm: str, keys: list[str]) -> dict:
    """One router arm's placement (its replicas and revision are filled in when handed out): every key's
    adapters, all on the one engine."""
    adapters = {name: ["engine-0"] for i in range(config.num_keys) for name in adapter_names(i, config.num_granted)}
    raw = {"pool": "bench", "baseModel": "base", "adapters": adapters}
    if arm.startswith("keys"):
        raw["apiKeys"] = build_table(True, build_grants(config, arm == "keys+limits", keys)).to_json()
    return raw


def roles(turn: int) -> list[str]:
    """The arm router j plays in a repeat's `turn`-th block."""
    return [ROUTER_ARMS[(j + turn) % len(ROUTER_ARMS)] for j in range(len(ROUTER_ARMS))]


def request_bodies(caller: Caller) -> list[bytes]:
    return [json.dumps({"model": model, "prompt": "Say hello to the router.", "max_tokens": 16}).encode()
            for model in caller.models]


async def drive(session, targets: list[tuple[str, str]], bodies: list[bytes], headers: dict, num_requests: int,
                concurrency: int) -> dict[str, list[float]]:
    """Seconds of each completion, `num_requests` per (arm, URL) target: the k-th request sent goes to target
    k mod len(targets), from `concurrency` clients. Any answer but 200 is an error."""
    latencies: dict[str, list[float]] = {arm: [] for arm, _ in targets}
    turns = iter(range(num_requests * len(targets)))

    async def client() -> None:
        for k in turns:
            arm, url = targets[k % len(targets)]
            start = time.perf_counter()
            async with session.post(url, data=bodies[k % len(bodies)], headers=headers) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{arm} arm answered {response.status}")
            latencies[arm].append(time.perf_counter() - start)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


@dataclass(frozen=True)
class Load:
    """What every request of the run sends."""
    bodies: list[bytes]
    headers: dict[str, str]
    concurrency: int


async def measure_repeat(session, fleet: Fleet, placements: dict[str, dict], load: Load,
                         num_requests: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """One block per router role: latencies and router CPU seconds per arm, summed over the blocks."""
    latencies: defaultdict[str, list[float]] = defaultdict(list)
    cpu_s: defaultdict[str, float] = defaultdict(float)
    for turn in range(len(ROUTER_ARMS)):
        arms = roles(turn)
        await hand_out(session, fleet, [placements[arm] for arm in arms])
        targets = [("engine", fleet.engine_url), *zip(arms, fleet.router_urls)]
        targets = [(arm, f"{url}/v1/completions") for arm, url in targets]
        await drive(session, targets, load.bodies, load.headers, NUM_SWAP_WARMUP, load.concurrency)
        before = [process_cpu_s(pid) for pid in fleet.router_pids]
        for arm, values in (await drive(session, targets, load.bodies, load.headers, num_requests,
                                        load.concurrency)).items():
            latencies[arm] += values
        for arm, pid, start in zip(arms, fleet.router_pids, before):
            cpu_s[arm] += process_cpu_s(pid) - start
    return latencies, cpu_s


async def measure(config: RouterKeysConfig, fleet: Fleet, placements: dict[str, dict],
                  caller: Caller) -> list[ArmSample]:
    import aiohttp

    headers = {"Authorization": f"Bearer {caller.key}", "Content-Type": "application/json"}
    samples = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for variant in VARIANTS:
            load = Load(request_bodies(caller), headers, 1 if variant == "sequential" else config.concurrency)
            targets = [("engine", fleet.engine_url), *zip(ROUTER_ARMS, fleet.router_urls)]
            await drive(session, [(arm, f"{url}/v1/completions") for arm, url in targets], load.bodies,
                        load.headers, config.num_warmup, load.concurrency)
            for repeat in range(config.num_repeats):
                latencies, cpu_s = await measure_repeat(session, fleet, placements, load, config.num_requests)
                samples += [ArmSample(arm, variant, repeat, tuple(latencies[arm]), cpu_s.get(arm)) for arm in ARMS]
            print(f"  {variant}: {config.num_repeats} repeats done", flush=True)
    return samples


def time_key_path(config: RouterKeysConfig, keys: list[str], caller: Caller) -> dict[str, float]:
    """Microseconds per request of what handle_inference does for a key, and of the open pool's authorize."""
    from kubelora.router.limits import KeyLimits

    header = [f"Bearer {caller.key}"]
    body = request_bodies(caller)[0]
    payload = json.loads(body)
    tables = {"open": build_table(False, []), "keys": build_table(True, build_grants(config, False, keys)),
              "keys+limits": build_table(True, build_grants(config, True, keys))}
    out = {}
    for arm, table in tables.items():
        limits, rounds = KeyLimits(), []
        for _ in range(NUM_KEY_PATH_ROUNDS):  # slower rounds were interrupted by the machine's other work
            start = time.perf_counter()
            for _ in range(config.num_key_path_calls):
                grant = table.authorize(header)
                check_model(grant, payload["model"], "base")
                if grant is not None:
                    limits.admit_request(grant, len(body), payload)
            rounds.append(time.perf_counter() - start)
        out[arm] = min(rounds) / config.num_key_path_calls * 1e6
    return out


def environment() -> dict[str, str]:
    import platform

    import aiohttp

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    return {"cpu": f"{model}, {os.cpu_count()} cores", "python": platform.python_version(),
            "aiohttp": aiohttp.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime())}


def run(config: RouterKeysConfig, workdir: Path, note: str = "") -> RouterKeysReport:
    keys = [secrets.token_hex(32) for _ in range(config.num_keys)]
    caller_index = config.num_keys // 2
    caller = Caller(keys[caller_index], tuple(adapter_names(caller_index, config.num_granted)))
    env = environment()
    load_before = os.getloadavg()[0]
    placements = {arm: placement(config, arm, keys) for arm in ROUTER_ARMS}
    fleet = start_fleet(workdir, len(ROUTER_ARMS), placements["open"], config.startup_timeout_s)
    try:
        samples = asyncio.run(measure(config, fleet, placements, caller))
    finally:
        fleet.stop()
    env["load average (1 min) before / after"] = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    return RouterKeysReport(env, config, samples, time_key_path(config, keys, caller), note)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubelora bench router-keys", description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1000, help="keys in the table")
    p.add_argument("--granted", type=int, default=4, help="adapters each key may call")
    p.add_argument("--requests", type=int, default=200, help="per arm and block (a repeat is one block per router arm)")
    p.add_argument("--concurrency", type=int, default=16, help="clients of the concurrent variant")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=200, help="requests per arm before the first repeat")
    p.add_argument("--write", default=None, help="write the markdown report to this path")
    p.add_argument("--note", default="", help="a paragraph printed above the tables (e.g. the machine's load)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = RouterKeysConfig(num_keys=args.keys, num_granted=args.granted, num_requests=args.requests,
                                  concurrency=args.concurrency, num_repeats=args.repeats, num_warmup=args.warmup)
    except ValueError as exc:
        return refuse("router-keys", exc)
    with work_folder("router-keys", None) as workdir:
        report = run(config, workdir, args.note)
    publish(render_markdown(report), args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
