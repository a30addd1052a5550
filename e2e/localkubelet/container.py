"""One container of a pod: its process, restarts with back-off, probes and status."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .launch import LaunchSpec, start_process
from .runtime import build_kill_commands
from .probes import ProbeSpec, ProbeState, ProbeTarget, run_probe
from .timeutil import now_rfc3339


@dataclass(frozen=True)
class Termination:
    exit_code: int
    reason: str
    started_at: str
    finished_at: str
    message: str = ""

    def to_state(self) -> dict:
        state = {"exitCode": self.exit_code, "reason": self.reason, "startedAt": self.started_at,
                 "finishedAt": self.finished_at}
        return {"terminated": {**state, "message": self.message} if self.message else state}


@dataclass(frozen=True)
class Backoff:
    base_s: float
    max_s: float

    def delay_s(self, num_failures: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, num_failures - 1))


class ContainerRunner:
    def __init__(self, container: dict, pod_dir: Path, backoff: Backoff) -> None:
        self.spec = container
        self.name: str = container["name"]
        self.restart_count = 0
        self.last_termination: Termination | None = None
        self.waiting = ("ContainerCreating", "")
        self._process: subprocess.Popen | None = None
        self._container_id = ""
        self._started_at = ""
        self._started_mono = 0.0
        self._next_start_at = 0.0
        self._num_failures = 0
        self._backoff = backoff
        self._probes: dict[str, ProbeState] = {}
        self._log_dir = pod_dir / "logs" / self.name
        self._pid_file = pod_dir / "containers" / f"{self.name}.pid"

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._process is not None

    @property
    def has_run(self) -> bool:
        return self.is_running or self.last_termination is not None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def can_start(self, now: float) -> bool:
        return not self.is_running and now >= self._next_start_at

    @property
    def container_id(self) -> str | None:
        """runc's id of the running attempt; None when not running."""
        return self._container_id if self._process else None

    @property
    def pid_file(self) -> Path:
        """The host pid of the container's main process; runc writes it (--pid-file)."""
        return self._pid_file

    def log_path(self, attempt: int) -> Path:
        return self._log_dir / f"{attempt}.log"

    def start(self, launch: LaunchSpec) -> None:
        self._pid_file.parent.mkdir(parents=True, exist_ok=True)
        self._process = start_process(launch)
        self._container_id = launch.container_id
        self._started_at, self._started_mono = now_rfc3339(), time.monotonic()
        self._probes = self._build_probes()
        self.waiting = ("", "")

    def mark_waiting(self, reason: str, message: str, retry_in_s: float) -> None:
        self.waiting = (reason, message)
        self._next_start_at = time.monotonic() + retry_in_s

    def poll_exit(self) -> Termination | None:
        """Reap the process if it exited; the caller decides whether to restart."""
        if self._process is None or self._process.poll() is None:
            return None
        return self._record_exit(self._process.returncode, "")

    def schedule_restart(self, termination: Termination) -> None:
        ran_for_s = time.monotonic() - self._started_mono
        # A container that ran well past the longest back-off starts the sequence over.
        self._num_failures = 1 if ran_for_s > 2 * self._backoff.max_s else self._num_failures + 1
        delay_s = self._backoff.delay_s(self._num_failures)
        self.restart_count += 1
        self._next_start_at = time.monotonic() + delay_s
        self.waiting = ("CrashLoopBackOff",
                        f"back-off {delay_s:.0f}s restarting failed container={self.name}")

    def kill(self, grace_s: float, reason: str = "") -> Termination | None:
        """SIGTERM the container's session (runc forwards it to the container), SIGKILL after `grace_s`."""
        process = self._process
        if process is None:
            return None
        signal_session(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=max(grace_s, 0.0))
        except subprocess.TimeoutExpired:
            self._kill_container()
            signal_session(process.pid, signal.SIGKILL)
            process.wait()
        signal_session(process.pid, signal.SIGKILL)  # stragglers it forked
        self._kill_container()
        return self._record_exit(process.returncode, reason)

    def _kill_container(self) -> None:
        """The container's processes are not in runc's session: runc kills them (and forgets the state
        `runc run` leaves behind when it is killed itself)."""
        for command in build_kill_commands(self._container_id):
            subprocess.run(command, capture_output=True, timeout=30)

    def _record_exit(self, returncode: int, reason: str) -> Termination:
        exit_code = 128 - returncode if returncode < 0 else returncode
        termination = Termination(exit_code, reason or ("Completed" if exit_code == 0 else "Error"),
                                  self._started_at, now_rfc3339())
        self.last_termination = termination
        self._process = None
        self._probes = {}
        self._pid_file.unlink(missing_ok=True)
        return termination

    # -- probes ----------------------------------------------------------------------------
    def _build_probes(self) -> dict[str, ProbeState]:
        now = time.monotonic()
        # Results before the first check: not started, not ready, alive.
        initial = {"startupProbe": False, "readinessProbe": False, "livenessProbe": True}
        return {kind: ProbeState(ProbeSpec.parse(self.spec[kind]), now, value)
                for kind, value in initial.items() if self.spec.get(kind)}

    def run_due_probes(self, target: ProbeTarget) -> bool:
        """Run the probes that are due; False means the container must be killed
        (liveness failed, or startup never succeeded within its threshold)."""
        now = time.monotonic()
        startup = self._probes.get("startupProbe")
        if startup is not None and not startup.result:
            self._run_if_due(startup, target, now)
            return not startup.has_failed
        for kind in ("readinessProbe", "livenessProbe"):
            probe = self._probes.get(kind)
            if probe is not None:
                self._run_if_due(probe, target, now)
        liveness = self._probes.get("livenessProbe")
        return liveness is None or liveness.result

    @staticmethod
    def _run_if_due(probe: ProbeState, target: ProbeTarget, now: float) -> None:
        if probe.is_due(now):
            probe.record(run_probe(probe.spec.handler, target, probe.spec.timeout_s), now)

    @property
    def is_started(self) -> bool:
        startup = self._probes.get("startupProbe")
        return self.is_running and (startup is None or startup.result)

    @property
    def is_ready(self) -> bool:
        readiness = self._probes.get("readinessProbe")
        return self.is_started and (readiness is None or readiness.result)

    # -- status ----------------------------------------------------------------------------
    def status(self, pod_key: str) -> dict:
        image = self.spec.get("image", "")
        result = {"name": self.name, "image": image, "imageID": f"kubelora-local://{image}",
                  "ready": self.is_ready, "started": self.is_started,
                  "restartCount": self.restart_count, "state": self._state(),
                  "lastState": {}}
        if self.is_running:
            result["containerID"] = f"kubelora://{pod_key}/{self.name}/{self.restart_count}"
            result["lastState"] = self.last_termination.to_state() if self.last_termination else {}
        elif self.last_termination is not None and self.waiting[0]:
            result["lastState"] = self.last_termination.to_state()
        return result

    def _state(self) -> dict:
        if self.is_running:
            return {"running": {"startedAt": self._started_at}}
        reason, message = self.waiting
        if reason or self.last_termination is None:
            waiting = {"reason": reason or "ContainerCreating"}
            return {"waiting": {**waiting, "message": message} if message else waiting}
        return self.last_termination.to_state()


def signal_session(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
