"""A real Prometheus for the e2e tests: the upstream server (built by e2e/prometheus/build.sh; Debian's package lacks
the Kubernetes service discovery) run as the test's own process, with its own configuration, data directory and
port, discovering the local cluster's pods through the API server (kubernetes_sd with the admin kubeconfig) and
scraping them by pod IP (docs/cluster.md: the host reaches every pod IP).

Its scrape jobs are translated from prometheus-operator monitors (ServiceMonitor, PodMonitor, as the API server
returns them) the way prometheus-operator generates them: kubernetes_sd over the monitor's namespaces, `keep`
relabellings for its label selector and port, the target labels prometheus-operator sets (namespace, pod,
container, service, endpoint, job) and the monitor's targetLabels / podTargetLabels. Only the fields kubelora's
chart uses are translated; any other field raises ValueError rather than scraping something other than what
prometheus-operator would. Its rule file holds the groups of PrometheusRule objects unchanged.

Standard library only, like the rest of e2e/ (the configuration is written as JSON, which Prometheus reads as YAML).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MONITOR_SPEC_FIELDS = {"ServiceMonitor": {"selector", "namespaceSelector", "endpoints", "targetLabels"},
                       "PodMonitor": {"selector", "namespaceSelector", "podMetricsEndpoints", "podTargetLabels"}}
ENDPOINT_FIELDS = {"port", "path", "interval", "honorLabels"}


def sanitize(label: str) -> str:
    """A Kubernetes label name as kubernetes_sd writes it in meta label names: kubelora.io/pool -> kubelora_io_pool."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def scrape_configs(monitors: list[dict[str, Any]], kubeconfig: Path) -> list[dict[str, Any]]:
    """One scrape job per endpoint of each monitor, named as prometheus-operator names them."""
    jobs = []
    for monitor in monitors:
        kind, spec = monitor["kind"], monitor["spec"]
        if kind not in MONITOR_SPEC_FIELDS:
            raise ValueError(f"{kind}: only ServiceMonitor and PodMonitor are translated")
        unknown = set(spec) - MONITOR_SPEC_FIELDS[kind]
        if unknown:
            raise ValueError(f"{kind} {monitor['metadata']['name']}: fields {sorted(unknown)} are not translated")
        endpoints = spec["endpoints"] if kind == "ServiceMonitor" else spec["podMetricsEndpoints"]
        for index, endpoint in enumerate(endpoints):
            jobs.append(_job(monitor, index, endpoint, kubeconfig))
    return jobs


def _job(monitor: dict[str, Any], index: int, endpoint: dict[str, Any], kubeconfig: Path) -> dict[str, Any]:
    unknown = set(endpoint) - ENDPOINT_FIELDS
    if unknown or "port" not in endpoint:
        raise ValueError(f"{monitor['metadata']['name']} endpoint {index}: needs a port; fields {sorted(unknown)} "
                         "are not translated")
    meta, spec = monitor["metadata"], monitor["spec"]
    is_service = monitor["kind"] == "ServiceMonitor"
    prefix = "serviceMonitor" if is_service else "podMonitor"
    sd: dict[str, Any] = {"role": "endpointslice" if is_service else "pod", "kubeconfig_file": str(kubeconfig)}
    namespaces = _namespaces(meta["namespace"], spec.get("namespaceSelector") or {})
    if namespaces is not None:
        sd["namespaces"] = {"names": namespaces}
    job: dict[str, Any] = {
        "job_name": f"{prefix}/{meta['namespace']}/{meta['name']}/{index}",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path", "/metrics"),
        "kubernetes_sd_configs": [sd],
    }
    if "interval" in endpoint:
        job["scrape_interval"] = endpoint["interval"]
    relabel = _service_relabelling(spec, endpoint) if is_service else _pod_relabelling(meta, spec, endpoint)
    job["relabel_configs"] = relabel
    return job


def _namespaces(own: str, selector: dict[str, Any]) -> list[str] | None:
    """None: every namespace (`any: true`); no selector: the monitor's own namespace."""
    if selector.get("any"):
        return None
    return list(selector.get("matchNames") or [own])


def _selector_keeps(object_kind: str, selector: dict[str, Any]) -> list[dict[str, Any]]:
    if set(selector) - {"matchLabels"}:
        raise ValueError(f"selector {selector}: only matchLabels is translated")
    return [{"action": "keep",
             "source_labels": [f"__meta_kubernetes_{object_kind}_label_{sanitize(key)}",
                               f"__meta_kubernetes_{object_kind}_labelpresent_{sanitize(key)}"],
             "regex": f"({re.escape(value)});true"}
            for key, value in sorted((selector.get("matchLabels") or {}).items())]


def _copy(source: str, target: str) -> dict[str, Any]:
    return {"source_labels": [source], "target_label": target}


def _service_relabelling(spec: dict, endpoint: dict) -> list[dict[str, Any]]:
    port = endpoint["port"]
    return [
        *_selector_keeps("service", spec.get("selector") or {}),
        {"action": "keep", "source_labels": ["__meta_kubernetes_endpointslice_port_name"], "regex": re.escape(port)},
        {"source_labels": ["__meta_kubernetes_endpointslice_address_target_kind",
                           "__meta_kubernetes_endpointslice_address_target_name"],
         "regex": "Pod;(.*)", "target_label": "pod", "replacement": "${1}"},
        _copy("__meta_kubernetes_namespace", "namespace"),
        _copy("__meta_kubernetes_service_name", "service"),
        _copy("__meta_kubernetes_pod_name", "pod"),
        _copy("__meta_kubernetes_pod_container_name", "container"),
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        _copy("__meta_kubernetes_service_name", "job"),
        *[_copy(f"__meta_kubernetes_service_label_{sanitize(label)}", sanitize(label))
          for label in spec.get("targetLabels") or []],
        {"target_label": "endpoint", "replacement": port},
    ]


def _pod_relabelling(meta: dict, spec: dict, endpoint: dict) -> list[dict[str, Any]]:
    port = endpoint["port"]
    return [
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        *_selector_keeps("pod", spec.get("selector") or {}),
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": re.escape(port)},
        _copy("__meta_kubernetes_namespace", "namespace"),
        _copy("__meta_kubernetes_pod_container_name", "container"),
        _copy("__meta_kubernetes_pod_name", "pod"),
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        *[_copy(f"__meta_kubernetes_pod_label_{sanitize(label)}", sanitize(label))
          for label in spec.get("podTargetLabels") or []],
        {"target_label": "endpoint", "replacement": port},
    ]


def rule_groups(prometheus_rules: list[dict[str, Any]]) -> dict[str, Any]:
    """A rules file of the PrometheusRules' groups, as they are."""
    return {"groups": [group for rule in prometheus_rules for group in rule["spec"]["groups"]]}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class LocalPrometheus:
    """A running prometheus process and a client of its HTTP API (Prometheus's docs: querying/api)."""
    url: str
    process: subprocess.Popen
    workdir: Path

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=30) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise ValueError(f"{path}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of `expr` now: [{"metric": {labels}, "value": [time, "value"]}, ...]."""
        return self.get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        return self.get("/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(step_s))["result"]

    def active_targets(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/targets", state="active")["activeTargets"]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: [{"labels", "annotations", "state", "activeAt", "value"}, ...]."""
        return self.get("/api/v1/alerts")["alerts"]

    def log_tail(self, num_lines: int = 20) -> str:
        return "\n".join((self.workdir / "prometheus.log").read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(binary: str, workdir: Path, jobs: list[dict[str, Any]], rules: dict[str, Any],
          evaluation_interval: str = "2s", timeout_s: float = 60) -> LocalPrometheus:
    """Writes prometheus.json and rules.json into `workdir`, starts `binary` on a free loopback port with its
    data in `workdir/data`, and returns once it answers /-/ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rules.json").write_text(json.dumps(rules, indent=1))
    config = {"global": {"evaluation_interval": evaluation_interval},
              "rule_files": [str(workdir / "rules.json")], "scrape_configs": jobs}
    (workdir / "prometheus.json").write_text(json.dumps(config, indent=1))
    port = free_port()
    with open(workdir / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.json'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prometheus = LocalPrometheus(f"http://127.0.0.1:{port}", process, workdir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}; its log:\n{prometheus.log_tail()}")
        try:
            with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=5) as response:
                if response.status == 200:
                    return prometheus
        except OSError:
            pass
        time.sleep(0.5)
    prometheus.stop()
    raise RuntimeError(f"prometheus not ready after {timeout_s:.0f} s; its log:\n{prometheus.log_tail()}")
