"""httpGet, tcpSocket and exec probes with Kubernetes' timing and threshold semantics."""
from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeSpec:
    handler: dict
    initial_delay_s: float
    period_s: float
    timeout_s: float
    success_threshold: int
    failure_threshold: int

    @staticmethod
    def parse(probe: dict) -> ProbeSpec:
        return ProbeSpec(
            handler=probe,
            initial_delay_s=probe.get("initialDelaySeconds", 0),
            period_s=probe.get("periodSeconds", 10),
            timeout_s=probe.get("timeoutSeconds", 1),
            success_threshold=probe.get("successThreshold", 1),
            failure_threshold=probe.get("failureThreshold", 3),
        )


class ProbeState:
    """Tracks one probe of one container attempt; `result` flips only past a threshold."""

    def __init__(self, spec: ProbeSpec, started_at: float, initial: bool) -> None:
        self.spec = spec
        self.result = initial
        self._next_at = started_at + spec.initial_delay_s
        self._successes = 0
        self._failures = 0

    @property
    def has_failed(self) -> bool:
        return self._failures >= self.spec.failure_threshold

    def is_due(self, now: float) -> bool:
        return now >= self._next_at

    def record(self, is_success: bool, now: float) -> None:
        self._next_at = now + self.spec.period_s
        if is_success:
            self._successes, self._failures = self._successes + 1, 0
            if self._successes >= self.spec.success_threshold:
                self.result = True
        else:
            self._successes, self._failures = 0, self._failures + 1
            if self._failures >= self.spec.failure_threshold:
                self.result = False


@dataclass(frozen=True)
class ProbeTarget:
    pod_ip: str
    ports: dict[str, int]   # named container ports
    env: dict[str, str]
    exec_prefix: tuple[str, ...] = ()  # runs an exec probe in the container (runc exec <id>)


def run_probe(handler: dict, target: ProbeTarget, timeout_s: float) -> bool:
    try:
        if "httpGet" in handler:
            return probe_http(handler["httpGet"], target, timeout_s)
        if "tcpSocket" in handler:
            return probe_tcp(handler["tcpSocket"], target, timeout_s)
        if "exec" in handler:
            return probe_exec(handler["exec"], target, timeout_s)
    except (OSError, ValueError, subprocess.SubprocessError):
        return False
    return False  # grpc probes are not supported: they fail (docs/cluster.md)


def resolve_port(port: int | str, target: ProbeTarget) -> int:
    return target.ports[port] if isinstance(port, str) and not port.isdigit() else int(port)


def probe_http(action: dict, target: ProbeTarget, timeout_s: float) -> bool:
    """The host reaches every pod IP through the bridge, as a real kubelet does."""
    scheme = action.get("scheme", "HTTP").lower()
    host = action.get("host") or target.pod_ip
    path = action.get("path", "/")
    url = f"{scheme}://{host}:{resolve_port(action['port'], target)}{path}"
    headers = {h["name"]: h["value"] for h in action.get("httpHeaders", [])}
    request = urllib.request.Request(url, headers={"User-Agent": "kube-probe/1.36", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return 200 <= response.status < 400
    except urllib.error.HTTPError as error:
        return 200 <= error.code < 400


def probe_tcp(action: dict, target: ProbeTarget, timeout_s: float) -> bool:
    host = action.get("host") or target.pod_ip
    with socket.create_connection((host, resolve_port(action["port"], target)), timeout=timeout_s):
        return True


def probe_exec(action: dict, target: ProbeTarget, timeout_s: float) -> bool:
    result = subprocess.run([*target.exec_prefix, *action["command"]], env=target.env, timeout=timeout_s,
                            capture_output=True)
    return result.returncode == 0
