"""The operator benchmark's processes: the operator as its CLI runs it, the fake engines, the real routers; and what
is read of them: CPU clocks, memory, the operator's metrics, the fakes' call counts.

- The operator: `kubelora operator --namespace NS --metrics-port P` (plus `--resync-seconds` when the bench sets
  one), with KUBECONFIG naming the bench's admin kubeconfig; nothing else differs from a pod's.
- The fake engines: one `kubelora.bench.operator_engines` process for every engine pod (operator_engines.py).
- The routers: real `kubelora router` processes, each run with its Deployment's container args plus
  `--kubeconfig` (the bench's admin credentials instead of its ServiceAccount token: the bench's API server has no
  token controller), `--host` its pod IP and `--log-level warning`. Each reads the placement ConfigMap from the
  API server once a second and answers the operator's `GET /placement?min_revision=` as in a cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kubelora.bench.operator_engines import FakeFleetConfig
from kubelora.bench.router_keys_fleet import process_cpu_s

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
_METRIC = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def _clean_env(kubeconfig: Path) -> dict[str, str]:
    """This environment without any KUBELORA_* setting (the processes take their flags only) and with the bench's
    kubeconfig."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBELORA_")}
    return {**env, "KUBECONFIG": str(kubeconfig)}


def _python(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", *args]


def start_operator(kubeconfig: Path, namespace: str, metrics_port: int, resync_s: float | None,
                   log_path: Path) -> subprocess.Popen:
    args = ["operator", "--namespace", namespace, "--metrics-port", str(metrics_port)]
    if resync_s is not None:
        args += ["--resync-seconds", f"{resync_s:g}"]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(_python("kubelora.cli.main", *args), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=_clean_env(kubeconfig))
    _wait_http(f"http://127.0.0.1:{metrics_port}/metrics", process, log_path)
    return process


def start_fakes(config: FakeFleetConfig, workdir: Path, log_path: Path) -> subprocess.Popen:
    """The fake engines' process, starting (`wait_listening` waits for it)."""
    config_path = workdir / "fake-engines.json"
    config_path.write_text(config.to_json())
    with open(log_path, "ab") as log:
        return subprocess.Popen(_python("kubelora.bench.operator_engines", str(config_path)), stdout=subprocess.PIPE,
                                stderr=log, stdin=subprocess.DEVNULL, text=True, env=_clean_env(workdir / "none"))


def wait_listening(fakes: subprocess.Popen, log_path: Path) -> None:
    line = fakes.stdout.readline()  # "listening" once every site is bound, "" when it exits
    if line.strip() != "listening":
        stop(fakes)
        raise RuntimeError(f"the fake engines did not start (exit {fakes.returncode}); see {log_path}")


def start_router(kubeconfig: Path, container_args: list[str], ip: str, log_path: Path) -> subprocess.Popen:
    """`kubelora <the Deployment's args> --kubeconfig K --host IP --log-level warning`, starting."""
    args = [*container_args, "--kubeconfig", str(kubeconfig), "--host", ip, "--log-level", "warning"]
    with open(log_path, "ab") as log:
        return subprocess.Popen(_python("kubelora.cli.main", *args), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_clean_env(kubeconfig))


def wait_router_ready(ip: str, port: int, process: subprocess.Popen, log_path: Path) -> None:
    """Until the router's /ready is 200: it has read a placement (its readiness probe in a cluster)."""
    _wait_http(f"http://{ip}:{port}/ready", process, log_path)


def _wait_http(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:g} s; see {log_path}")


def stop(*processes: subprocess.Popen) -> None:
    """SIGTERM to all at once, then wait for each; SIGKILL for one still running after STOP_TIMEOUT_S."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Memory:
    rss_bytes: int
    peak_rss_bytes: int  # VmHWM: the largest RSS since the process started


def memory(pid: int) -> Memory:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return Memory(fields["VmRSS"], fields["VmHWM"])


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """name -> CPU seconds (every thread) of each process that still runs."""
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = process_cpu_s(pid)
        except RuntimeError:
            pass
    return out


@dataclass(frozen=True)
class OperatorCounters:
    """Read from the operator's /metrics (the pool's series)."""
    passes: float
    whole_passes: float  # passes that read every adapter and model list (the others: for changed adapters only)
    pass_seconds: float  # the passes' durations summed
    loads: float
    unloads: float
    call_errors: float


def read_operator_metrics(port: int) -> OperatorCounters:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match is None:
            continue
        name, labels, value = match["name"], match["labels"] or "", float(match["value"])
        if name == "kubelora_operator_engine_calls_total":
            call = "load" if 'call="load"' in labels else "unload"
            key = f"{call}_error" if 'result="error"' in labels else call
        else:
            key = name
        totals[key] = totals.get(key, 0.0) + value
    return OperatorCounters(totals.get("kubelora_operator_reconcile_passes_total", 0.0),
                            totals.get("kubelora_operator_reconcile_whole_passes_total", 0.0),
                            totals.get("kubelora_operator_reconcile_duration_seconds_sum", 0.0),
                            totals.get("load", 0.0) + totals.get("load_error", 0.0),
                            totals.get("unload", 0.0) + totals.get("unload_error", 0.0),
                            totals.get("load_error", 0.0) + totals.get("unload_error", 0.0))


def read_fake_counts(control_port: int) -> dict[str, dict]:
    """pod IP -> its counts (operator_engines.PodCounts.as_json)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{control_port}/counts", timeout=30) as response:
        return json.loads(response.read())


def read_held(control_port: int, prefix: str) -> dict[str, int]:
    """pod IP -> how many adapters whose names start with `prefix` the fake holds."""
    with urllib.request.urlopen(f"http://127.0.0.1:{control_port}/held?prefix={prefix}", timeout=30) as response:
        return json.loads(response.read())


def read_requests(control_port: int) -> dict[str, dict[str, int]]:
    """pod IP -> its requests by kind (operator_engines.REQUEST_KINDS)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{control_port}/requests", timeout=30) as response:
        return json.loads(response.read())
