"""The chart's monitoring, proven on a real Prometheus (e2e/localprometheus.py: the upstream server, built by
e2e/prometheus/build.sh, run as this test's own process) scraping the local cluster (docs/cluster.md).

The chart is installed with its ServiceMonitor, PodMonitors and PrometheusRule (prometheus-operator's CRDs on the
API server). Prometheus's scrape jobs are translated from the monitors as the API server returns them, and its rules
are the PrometheusRule's groups, unchanged. One pool runs one engine and one router; its engine holds one adapter
on the device and one in host memory (maxLoras 1, maxCpuLoras 1) while three clients ask the router for six in
turn: adapters are evicted and loaded again all the time, requests wait for them (the thrash the alert is for). One
of the six has its weights file broken after registration, so its loads on demand fail. Asserted through
Prometheus's HTTP API: the targets are exactly the pods the monitors select and all up; the engine exports series
for every adapter, the operator its reconcile metrics (the leader 1, the standby 0); every dashboard query returns
series; the thrash alert fires on the engine pod (installed with a `for` of THRASH_FOR_S instead of the shipped
10m, which would outlast the test) and so does the load-failure alert.

With KUBELORA_DASHBOARD_SERIES=<path> the traffic runs for SERIES_MIN_S and each dashboard row's series are written
there for the docs' pictures (`python -P -m kubelora.cli.dashboard_plots <path>`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import localprometheus
import pytest
from pytest_cluster import wait_for

from kubelora.cli import dashboard, dashboard_plots

from .conftest import CHART, REPO, run_helm
from .monitoring_crds import install_monitoring_crds

POOL = "mpool"
ADAPTERS = ("t0", "t1", "t2", "t3", "t4", "broken")
POOL_YAML = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAPool
metadata: {{name: {pool}}}
spec:
  model: {{path: /models/tiny, servedName: tiny}}
  modelVolume: {{hostPath: {models}, mountPath: /models}}
  adapterVolume: {{hostPath: {adapters}, mountPath: /adapters}}
  adapterRoots: [/adapters]
  replicas: 1
  router: {{enabled: true, replicas: 1}}
  engine: {{device: cpu, maxLoras: 1, maxCpuLoras: 1, maxLoraRank: 8, maxModelLen: 256, maxNumSeqs: 8}}
"""
ADAPTER_YAML = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{pool: {pool}, source: {{path: /adapters/{name}}}, replicas: 1}}
"""
# Fewer clients than adapters: the engine keeps the host copy of an adapter while it has requests in flight, so with
# one client per adapter every copy would stay; with three, the adapters asked for next must be loaded again.
NUM_CLIENTS = 3
# The thrash alert's `for` in this install (metrics.prometheusRule.for): a few of this Prometheus's 2 s evaluations,
# so the alert is pending first, and short enough to fire within the test.
THRASH_FOR_S = 10
# Where to write each dashboard row's series for the docs' pictures (kubelora.cli.dashboard_plots), after this long
# a run; unset: nothing is written and the run is as short as its tests.
SERIES_ENV = "KUBELORA_DASHBOARD_SERIES"
SERIES_MIN_S = 150
# Grafana's value of $__rate_interval with a data source's default 15 s scrape interval (4 x 15 s).
RATE_INTERVAL = "1m"


@dataclass
class Traffic:
    """Clients in threads, each asking the router for the adapters in turn (small completions), until stopped."""
    router_ip: str
    stop: threading.Event = field(default_factory=threading.Event)
    statuses: Counter = field(default_factory=Counter)
    threads: list[threading.Thread] = field(default_factory=list)
    started_at: float = 0.0  # unix seconds

    def start(self) -> None:
        self.started_at = time.time()
        for index in range(NUM_CLIENTS):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, index: int) -> None:
        for model in itertools.islice(itertools.cycle(ADAPTERS), index, None):
            if self.stop.is_set():
                return
            self.statuses[complete(self.router_ip, model)] += 1

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=70)


def complete(router_ip: str, model: str) -> int:
    body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{router_ip}:8080/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


@dataclass(frozen=True)
class Monitored:
    cluster: object
    namespace: str
    prometheus: localprometheus.LocalPrometheus
    monitors: list[dict]
    engine_pod: str
    traffic: Traffic


def ready_pods(cluster, namespace: str, selector: str) -> dict[str, str]:
    """name -> pod IP of the Ready pods matching `selector`."""
    pods = cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in pods
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])}


def served_models(engine_ip: str) -> set[str]:
    with urllib.request.urlopen(f"http://{engine_ip}:8000/v1/models", timeout=10) as response:
        return {m["id"] for m in json.load(response)["data"]}


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> Path:
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("monitoring-e2e")
    root.chmod(0o755)
    model_dir = make_tiny_model(root / "models" / "tiny")
    for seed, name in enumerate(ADAPTERS):
        make_adapter(root / "adapters" / name, model_dir, rank=4 + 4 * (seed % 2), seed=seed)
    return root


@pytest.fixture(scope="module")
def prometheus_binary(shown) -> str:
    """Built from its Go module the first time (minutes; the build prints its progress), cached after."""
    with shown():
        built = subprocess.run([str(REPO / "e2e" / "prometheus" / "build.sh")], stdout=subprocess.PIPE, text=True,
                               timeout=1800)
    assert built.returncode == 0, "e2e/prometheus/build.sh failed (see its output above)"
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def monitored(cluster, helm, prometheus_binary, material, tmp_path_factory) -> Iterator[Monitored]:
    suffix = uuid.uuid4().hex[:6]
    # A release name of its own: the chart's cluster-scoped objects are named after it, and test sessions may share
    # the cluster.
    namespace, release = f"klr-mon-{suffix}", f"mon-{suffix}"
    kube = ["--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace]
    started = time.monotonic()
    install_monitoring_crds(cluster)
    run_helm(helm, "install", release, str(CHART), *kube, "--create-namespace",
             "--set", f"watchNamespaces={{{namespace}}}", "--set", "operator.resyncSeconds=5",
             "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.interval=2s",
             "--set", "metrics.prometheusRule.enabled=true",
             "--set", f"metrics.prometheusRule.for.KubeloraAdapterThrash={THRASH_FOR_S}s")
    prometheus = traffic = None
    try:
        monitors = [cluster.get_json(kind, "-n", namespace)["items"] for kind in ("servicemonitors", "podmonitors")]
        monitors = [m for items in monitors for m in items]
        rules = cluster.get_json("prometheusrules", "-n", namespace)["items"]
        prometheus = localprometheus.start(
            prometheus_binary, tmp_path_factory.mktemp("prometheus"),
            localprometheus.scrape_configs(monitors, cluster.kubeconfig), localprometheus.rule_groups(rules))
        cluster.apply(POOL_YAML.format(pool=POOL, models=material / "models", adapters=material / "adapters"),
                      namespace=namespace)
        for name in ADAPTERS:
            cluster.apply(ADAPTER_YAML.format(name=name, pool=POOL), namespace=namespace)
        selector = f"kubelora.io/pool={POOL},app.kubernetes.io/component="
        ((engine_pod, engine_ip),) = wait_for("a ready engine", lambda: ready_pods(
            cluster, namespace, selector + "engine"), timeout_s=240).items()
        ((_, router_ip),) = wait_for("a ready router", lambda: ready_pods(
            cluster, namespace, selector + "router"), timeout_s=120).items()
        wait_for("every adapter registered on the engine", lambda: set(ADAPTERS) <= served_models(engine_ip),
                 timeout_s=120)
        # Registered, then broken: every load of it on demand (after each eviction) fails.
        (material / "adapters" / "broken" / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        traffic = Traffic(router_ip)
        traffic.start()
        print(f"\n[monitoring-e2e] chart, pool and Prometheus up, traffic started in "
              f"{time.monotonic() - started:.0f} s", flush=True)
        yield Monitored(cluster, namespace, prometheus, monitors, engine_pod, traffic)
    finally:
        if traffic is not None and os.environ.get(SERIES_ENV):
            time.sleep(max(0.0, SERIES_MIN_S - (time.time() - traffic.started_at)))
            series = dashboard_series(prometheus, namespace, traffic.started_at - 20, time.time())
            Path(os.environ[SERIES_ENV]).write_text(json.dumps(series))
        if traffic is not None:
            traffic.close()
            print(f"[monitoring-e2e] answers by status: {dict(traffic.statuses)}", flush=True)
        if prometheus is not None:
            prometheus.stop()
        for kind in ("loraadapters", "lorapools"):
            cluster.kubectl("delete", kind, "--all", "-n", namespace, "--timeout=60s", check=False, timeout_s=90)
        run_helm(helm, "uninstall", release, *kube, "--wait", "--timeout", "60s")
        cluster.kubectl("delete", "namespace", namespace, "--timeout=90s", check=False, timeout_s=120)


def dashboard_series(prometheus, namespace: str, start: float, end: float) -> dict:
    """Each row's graph panels with their queries' ranges, in the form kubelora.cli.dashboard_plots draws."""
    rows: list[dict] = []
    for panel in dashboard.build_dashboard()["panels"]:
        if panel["type"] == "row":
            rows.append({"title": panel["title"], "panels": []})
        elif panel["type"] == "timeseries":  # tables (max_lora) are label values, not lines
            series = [{"legend": dashboard_plots.legend(target.get("legendFormat", ""), found["metric"]),
                       "points": [[float(t), float(v)] for t, v in found["values"]]}
                      for target in panel["targets"]
                      for found in prometheus.query_range(substituted(target["expr"], namespace), start, end, 2)]
            rows[-1]["panels"].append({"title": panel["title"], "series": series,
                                       "unit": panel["fieldConfig"]["defaults"].get("unit", "")})
    return {"rows": rows}


def selected_pods(cluster, monitor: dict) -> set[str]:
    """The pods a monitor selects, as the API server answers its label selector (not through Prometheus)."""
    spec, namespace = monitor["spec"], monitor["metadata"]["namespace"]
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    namespaces = (spec.get("namespaceSelector") or {}).get("matchNames") or [namespace]
    if monitor["kind"] == "PodMonitor":
        port = spec["podMetricsEndpoints"][0]["port"]
        return {p["metadata"]["name"] for ns in namespaces
                for p in cluster.get_json("pods", "-n", ns, "-l", selector)["items"]
                if p["status"].get("phase") not in ("Failed", "Succeeded")
                and any(port == q.get("name") for c in p["spec"]["containers"] for q in c.get("ports") or [])}
    port = spec["endpoints"][0]["port"]
    pods = set()
    for ns in namespaces:
        for service in cluster.get_json("services", "-n", ns, "-l", selector)["items"]:
            slices = cluster.get_json("endpointslices", "-n", ns, "-l",
                                      f"kubernetes.io/service-name={service['metadata']['name']}")["items"]
            pods |= {e["targetRef"]["name"] for s in slices if any(p.get("name") == port for p in s["ports"] or [])
                     for e in s["endpoints"] or [] if e.get("targetRef", {}).get("kind") == "Pod"}
    return pods


def scraped_pods(prometheus) -> dict[str, set[str]]:
    """job -> pods of its active targets that are up."""
    found: dict[str, set[str]] = {}
    for target in prometheus.active_targets():
        if target["health"] == "up":
            found.setdefault(target["scrapePool"], set()).add(target["labels"]["pod"])
    return found


def test_prometheus_scrapes_exactly_the_pods_the_monitors_select(monitored):
    expected = {f"{'serviceMonitor' if m['kind'] == 'ServiceMonitor' else 'podMonitor'}/"
                f"{m['metadata']['namespace']}/{m['metadata']['name']}/0": selected_pods(monitored.cluster, m)
                for m in monitored.monitors}
    assert sorted(len(pods) for pods in expected.values()) == [1, 1, 2]  # engine, router; two operator replicas
    wait_for("every selected pod scraped and up", lambda: scraped_pods(monitored.prometheus) == expected,
             timeout_s=60)
    targets = monitored.prometheus.active_targets()
    assert {t["labels"]["pod"] for t in targets} == set().union(*expected.values())
    engine = next(t for t in targets if t["labels"]["pod"] == monitored.engine_pod)
    assert engine["labels"]["kubelora_io_pool"] == POOL and engine["labels"]["namespace"] == monitored.namespace


def values(prometheus, expr: str) -> dict[tuple, float]:
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in prometheus.query(expr)}


def adapters(found: dict[tuple, float]) -> set[str]:
    return {dict(labels)["adapter"] for labels in found}


def test_engine_exports_every_adapter_and_the_operator_its_reconcile_metrics(monitored):
    prometheus, scope = monitored.prometheus, f'namespace="{monitored.namespace}"'
    query = f'kubelora_adapter_residency{{{scope}, kubelora_io_pool="{POOL}"}}'
    residency = wait_for("every adapter's residency", lambda: found if adapters(
        found := values(prometheus, query)) >= set(ADAPTERS) else None, timeout_s=30)
    by_adapter = Counter(dict(k)["adapter"] for k, v in residency.items() if v == 1)
    assert all(by_adapter[name] == 1 for name in ADAPTERS), by_adapter  # one tier at a time
    for metric in ("kubelora_requests_waiting", "kubelora_requests_running"):
        assert adapters(values(prometheus, f"{metric}{{{scope}}}")) >= set(ADAPTERS), metric

    pool = f'{scope}, pool="{POOL}"'
    assert wait_for("reconcile passes", lambda: sum(values(
        prometheus, f"kubelora_operator_reconcile_passes_total{{{pool}}}").values()), timeout_s=30) > 0
    assert sum(values(prometheus, f"kubelora_operator_reconcile_duration_seconds_count{{{pool}}}").values()) > 0
    # The operator's pods are scraped apart from the engine's: its counters may reach Prometheus a scrape later
    # than the residency they caused.
    loads = f'kubelora_operator_engine_calls_total{{{pool}, call="load", result="ok"}}'
    assert wait_for("the operator's loads", lambda: sum(values(prometheus, loads).values()) >= len(ADAPTERS),
                    timeout_s=30)  # every adapter registered on the engine at least once
    phases = f"kubelora_operator_adapters{{{pool}}}"
    assert wait_for("adapters by phase", lambda: sum(values(prometheus, phases).values()) == len(ADAPTERS),
                    timeout_s=30)
    leader = f'kubelora_operator_leader{{job=~"{monitored.namespace}/.*-operator"}}'
    leaders = wait_for("both operator replicas' leader gauge",
                       lambda: found if len(found := values(prometheus, leader)) == 2 else None, timeout_s=30)
    assert sorted(leaders.values()) == [0.0, 1.0]  # the leader and the standby


def substituted(expr: str, namespace: str) -> str:
    """A dashboard query with Grafana's variables as Grafana fills them: this namespace and pool, All adapters."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", namespace)
            .replace("$pool", POOL).replace("$adapter", ".*"))


def test_every_dashboard_query_returns_series(monitored):
    board = dashboard.build_dashboard()
    queries = [(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
    variables = [(v["name"], re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]))
                 for v in board["templating"]["list"] if v["type"] == "query"]
    prometheus = monitored.prometheus

    def empty() -> list[tuple[str, str]]:
        missing = [(title, expr) for title, expr in queries
                   if not prometheus.query(substituted(expr, monitored.namespace))]
        missing += [(f"variable {name}", match.group(1)) for name, match in variables
                    if not any(match.group(2) in r["metric"]
                               for r in prometheus.query(substituted(match.group(1), monitored.namespace)))]
        return missing

    # The router's rejections count once it has rejected something: a model it does not know. (Its upstream errors
    # and the operator's reconcile errors exist at 0 from the start.)
    for _ in range(3):
        assert complete(monitored.traffic.router_ip, "no-such-adapter") == 404
    left = empty()
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:  # a rate needs two samples after the counter appears
        time.sleep(2)
        left = empty()
    assert not left, "\n".join(f"{title}: {expr}" for title, expr in left)


def alerts_on_engine(monitored, name: str) -> list[dict]:
    return [a for a in monitored.prometheus.alerts() if a["labels"]["alertname"] == name
            and a["labels"].get("namespace") == monitored.namespace and a["labels"].get("pod") == monitored.engine_pod]


def thrash_firing(monitored) -> list[dict]:
    """KubeloraAdapterThrash firing on the engine pod, each with the seconds since it became active (pending)."""
    now = time.time()
    return [{**a, "active_s": now - datetime.fromisoformat(a["activeAt"]).timestamp()}
            for a in alerts_on_engine(monitored, "KubeloraAdapterThrash") if a["state"] == "firing"]


def test_thrash_fires_the_thrash_alert_and_broken_loads_fire_theirs(monitored):
    (rule,) = [r for g in monitored.prometheus.get("/api/v1/rules", type="alert")["groups"] for r in g["rules"]
               if r["name"] == "KubeloraAdapterThrash"]
    assert rule["duration"] == THRASH_FOR_S  # the chart value, as Prometheus loaded it
    try:
        (thrash,) = wait_for("KubeloraAdapterThrash firing on the engine pod", lambda: thrash_firing(monitored),
                             timeout_s=90 + THRASH_FOR_S, interval_s=2)
    except AssertionError as error:
        scope = f'namespace="{monitored.namespace}", pod="{monitored.engine_pod}"'
        parts = {expr: values(monitored.prometheus, expr) for expr in (
            f"rate(kubelora_adapter_evictions_total{{{scope}}}[5m])",
            f"rate(kubelora_adapter_loads_total{{{scope}}}[5m])", f"kubelora_requests_waiting{{{scope}}} > 0")}
        active = alerts_on_engine(monitored, "KubeloraAdapterThrash")
        raise AssertionError(f"{error}; the alert's parts now: {parts}; active: {active}; "
                             f"answers: {dict(monitored.traffic.statuses)}")
    assert thrash["active_s"] >= THRASH_FOR_S and float(thrash["value"]) > 0.05  # pending for `for`, then firing
    assert thrash["labels"]["kubelora_io_pool"] == POOL and thrash["labels"]["severity"] == "warning"
    assert thrash["annotations"]["runbook_url"].endswith("#kubeloraadapterthrash")
    (failures,) = wait_for("KubeloraEngineAdapterLoadFailures firing on the engine pod", lambda: [
        a for a in alerts_on_engine(monitored, "KubeloraEngineAdapterLoadFailures") if a["state"] == "firing"],
        timeout_s=60, interval_s=2)
    assert float(failures["value"]) > 0
    assert monitored.traffic.statuses[200] > 0  # the other adapters' requests were served all along
