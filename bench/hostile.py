"""The hostile-tenant benchmark: what one tenant's worst allowed request costs the others on a live server.

    kubelora bench hostile [--device cpu|cuda] [--model-dir DIR] [--classes a,b] [--repeats 3]
        [--prompt-len 32] [--max-tokens 32] [--write docs/benchmarks-hostile.md]

`kubelora engine serve` runs on loopback (a random tiny llama unless --model-dir is given). For each class of
bench/hostile_classes.py, each repeat runs a victim (a greedy base-model completion of the class's token count)
beside the class's plain twin, then beside its hostile request, while /health is polled every 20 ms
(bench/hostile_measure.py). Reported per class: the hostile request's status (refused: every repeat 4xx),
/health p99 and max during the hostile runs, the victim ratio (median victim time beside the hostile request over
that beside the twin), and whether the victim's answer equals its answer alone. Targets: /health p99 under
100 ms, victim ratio within 2x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path

from kubelora.bench.command import publish, refuse, work_folder
from kubelora.bench.hostile_classes import CLASSES, Probe, Workload, write_pathological_config
from kubelora.bench.hostile_measure import ClassResult, Endpoints, measure_class, victim_alone
from kubelora.bench.hostile_report import render_markdown

HEALTH_INTERVAL_S = 0.02
ADAPTER_RANK = 8


@dataclass(frozen=True)
class HostileConfig:
    device: str = "cpu"
    model_dir: Path | None = None  # None: a random tiny llama
    classes: tuple[str, ...] = tuple(CLASSES)
    num_repeats: int = 3
    prompt_len: int = 32
    max_tokens: int = 32
    server_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.classes) - set(CLASSES))
        if unknown or not self.classes:
            raise ValueError(f"classes must be a non-empty subset of {', '.join(CLASSES)}, got {unknown or '[]'}")
        for name in ("num_repeats", "prompt_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"HostileConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class HostileReport:
    env: dict[str, str]
    config: HostileConfig
    shape: dict[str, int]
    results: list[ClassResult]
    note: str = ""  # printed above the table (e.g. how shared the machine was)


def prompt_ids(seed: int, length: int, vocab_size: int) -> list[int]:
    """Distinct ordinary token ids (not the specials at the front of the vocabulary)."""
    return [(17 + 31 * seed + 7 * j) % (vocab_size - 20) + 10 for j in range(length)]


def prepare(config: HostileConfig, workdir: Path) -> tuple[Path, Workload]:
    from kubelora.bench.engine_assets import AdapterSpec, shape_of, write_adapters
    from kubelora.cli.tiny import make_tiny_model

    model_dir = config.model_dir or make_tiny_model(workdir / "model", max_position_embeddings=2048)
    shape = shape_of(model_dir)
    adapters = workdir / "adapters"
    [plain] = write_adapters(adapters, [AdapterSpec("plain", ADAPTER_RANK)], shape, model_dir, "cpu").values()
    pathological = write_pathological_config(plain, adapters / "pathological")
    workload = Workload("base", prompt_ids(0, config.prompt_len, shape.vocab_size), config.max_tokens,
                        shape.vocab_size, plain, pathological)
    return model_dir, workload


def start_server(config: HostileConfig, model_dir: Path, workdir: Path):
    from kubelora.bench.engine_http import Server, ServerSettings

    admin_port = free_port()
    # Flags after the Server's own win (argparse keeps the last): a known admin port for the adapter-load class.
    flags = ("--admin-port", str(admin_port), "--adapter-root", str(workdir / "adapters"))
    settings = ServerSettings(model_dir=model_dir, adapters={}, device=config.device, max_loras=2,
                              max_lora_rank=ADAPTER_RANK, max_cpu_loras=4,
                              max_model_len=config.prompt_len + config.max_tokens + 16, max_num_seqs=128,
                              engine_flags=flags)
    server = Server(settings, workdir / "server.log")
    try:
        server.wait_ready(config.server_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server, Endpoints(server.url, f"http://127.0.0.1:{admin_port}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def victim_probe(workload: Workload) -> Probe:
    body = {"model": workload.model, "prompt": prompt_ids(1, len(workload.prompt), workload.vocab_size),
            "max_tokens": workload.max_tokens, "temperature": 0.0, "ignore_eos": True}
    return Probe("/v1/completions", json.dumps(body).encode())


async def _measure(config: HostileConfig, endpoints: Endpoints, workload: Workload) -> list[ClassResult]:
    import aiohttp

    victim = victim_probe(workload)
    timeout = aiohttp.ClientTimeout(total=config.server_timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        expected = await victim_alone(session, endpoints, victim)  # also warms the server up
        results = []
        for name in config.classes:
            built = [CLASSES[name](replace(workload, variant=i)) for i in range(config.num_repeats)]
            results.append(await measure_class(session, endpoints, built, victim, expected, HEALTH_INTERVAL_S))
            print(f"  {results[-1].name}: statuses {results[-1].statuses}", flush=True)
    return results


def run(config: HostileConfig, workdir: Path, note: str = "") -> HostileReport:
    from kubelora.bench.engine_assets import shape_of
    from kubelora.bench.engine_device import environment

    model_dir, workload = prepare(config, workdir)
    server, endpoints = start_server(config, model_dir, workdir)
    try:
        results = asyncio.run(_measure(config, endpoints, workload))
    finally:
        server.stop()
    env = {**environment(config.device), "cpu cores": str(os.cpu_count()),
           "load average (1, 5, 15 min) after the run": ", ".join(f"{x:.1f}" for x in os.getloadavg())}
    return HostileReport(env, config, shape_of(model_dir).as_dict(), results, note)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubelora bench hostile", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-dir", type=Path, default=None, help="a Llama-family model (default: a random tiny one)")
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma list of {', '.join(CLASSES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the model, adapters and server log here")
    p.add_argument("--write", default=None, help="write the markdown report to this path")
    p.add_argument("--note", default="", help="a paragraph printed above the table (e.g. the machine's load)")
    return p


def config_from_args(args: argparse.Namespace) -> HostileConfig:
    classes = tuple(c.strip() for c in args.classes.split(",") if c.strip())
    return HostileConfig(device=args.device, model_dir=args.model_dir, classes=classes, num_repeats=args.repeats,
                         prompt_len=args.prompt_len, max_tokens=args.max_tokens, server_timeout_s=args.server_timeout)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        return refuse("hostile", exc)
    with work_folder("hostile", args.workdir) as workdir:
        report = run(config, workdir, args.note)
    publish(render_markdown(report), args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
