"""Daemons started by `up`, tracked by pid files so `down` stops exactly those processes."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Daemon:
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def start(daemon: Daemon, pid_dir: Path, log_dir: Path) -> int:
    """Start `daemon` unless its recorded pid is still running it; return its pid."""
    pid = running_pid(daemon.name, pid_dir)
    if pid is not None:
        return pid
    pid_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{daemon.name}.log", "ab") as log:
        # A new session: `down` signals the daemon alone, and a Ctrl-C in the terminal that
        # ran `up` does not reach the cluster.
        process = subprocess.Popen(daemon.argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, **dict(daemon.env)})
    (pid_dir / f"{daemon.name}.pid").write_text(f"{process.pid} {daemon.argv[0]}\n")
    return process.pid


def running_pid(name: str, pid_dir: Path) -> int | None:
    """The pid recorded for `name` if that process still runs the recorded program.

    Comparing the program guards against a recycled pid after a reboot or a crash.
    """
    pid_file = pid_dir / f"{name}.pid"
    if not pid_file.exists():
        return None
    pid_text, _, program = pid_file.read_text().strip().partition(" ")
    pid = int(pid_text)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
    if state == "Z" or program.encode() not in cmdline:
        return None
    return pid


def stop(name: str, pid_dir: Path, grace_s: float = 10.0) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; the daemon's session goes with it."""
    pid = running_pid(name, pid_dir)
    if pid is not None:
        signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and is_alive(pid):
            time.sleep(0.1)
        signal_group(pid, signal.SIGKILL)
    (pid_dir / f"{name}.pid").unlink(missing_ok=True)


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_exited(pid: int, timeout_s: float) -> bool:
    """Wait until `pid` no longer runs; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
