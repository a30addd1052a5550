"""`kubelora demo` (default): the whole system on this machine, on a tiny built-in model.

A real Kubernetes control plane (e2e/cluster: kube-apiserver, etcd, controller-manager, scheduler and the
local kubelet), the Helm chart (CRDs, operator, RBAC), one `LoRAPool` with its router, three `LoRAAdapter`s
applied with kubectl and hot-loaded by the operator, and tenants calling the router with the openai SDK.
Needs the repository checkout (e2e/, charts/), root, Go, iproute2 and openssl: docs/cluster.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kubelora.cli.demo import (DEMO_ADAPTERS, DEMO_PROMPTS, MAX_TOKENS, build_demo_material, check_answer,
                               print_answer)

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "kubelora-demo"
POOL = "demo"
SERVED_NAME = "tiny-llama"
ROUTER_PORT = 8080
WAIT_S = 240
# The adapter placed on every engine replica, and the one the demo deletes at the end.
EVERYWHERE, DELETED = "pirate", "legal"


_STARTED = time.monotonic()
_CURRENT_STEP = ["preparing"]  # the step a failure is reported against
OPERATOR_PODS = "app.kubernetes.io/component=operator"


def _step(message: str) -> None:
    """A step of the demo, with the seconds since the demo started (where a cached demo spends its time)."""
    _CURRENT_STEP[0] = message
    print(f"== [{time.monotonic() - _STARTED:5.1f} s] {message}", flush=True)


def _report_failure(error: Exception, kubectl: Kubectl | None) -> None:
    """One readable account of a failed step instead of a traceback: the step, the error, and where to look
    (the pods, the operator's last log lines, the control plane's own logs)."""
    out = sys.stderr
    print(f"== the demo failed while {_CURRENT_STEP[0]!r}:\n{error}", file=out)
    if kubectl is not None:
        print("== pods (e2e/kubectl get pods -A -o wide):", file=out)
        print(kubectl("get", "pods", "-A", "-o", "wide", check=False).rstrip(), file=out)
        logs = kubectl("logs", "-n", "kubelora-system", "-l", OPERATOR_PODS, "--tail=20", "--prefix", check=False)
        if logs.strip():
            print("== the operator's last log lines:", file=out)
            print(logs.rstrip(), file=out)
    print("== the control plane's component logs: the logs/ folder of the state directory `e2e/cluster status` "
          "names (docs/cluster.md)", file=out, flush=True)


def _run(*command: str, env: dict | None = None, check: bool = True, timeout: float = 900) -> str:
    result = subprocess.run(list(command), capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


class Kubectl:
    def __init__(self, kubeconfig: str) -> None:
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}
        self.binary = str(REPO / "e2e" / "kubectl")

    def __call__(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        result = subprocess.run([self.binary, *args], capture_output=True, text=True, env=self.env,
                                input=stdin, timeout=WAIT_S + 30)
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def apply(self, manifest: dict) -> None:
        self("apply", "-f", "-", stdin=json.dumps(manifest))


def _pool_manifest(root: Path) -> dict:
    volume = lambda path, mount: {"hostPath": str(path), "mountPath": mount, "readOnly": True}  # noqa: E731
    return {
        "apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAPool",
        "metadata": {"name": POOL, "namespace": NAMESPACE},
        "spec": {
            "model": {"path": "/models/tiny", "servedName": SERVED_NAME},
            "modelVolume": volume(root / "model", "/models/tiny"),
            "adapterVolume": volume(root / "adapters", "/adapters"),
            "adapterRoots": ["/adapters"],
            "replicas": 2,
            "engine": {"maxLoras": 2, "maxLoraRank": 16, "maxCpuLoras": 4, "maxModelLen": 256, "device": "cpu"},
            "router": {"enabled": True},
        },
    }


def _adapter_manifest(name: str, rank: int, replicas: int | str) -> dict:
    return {
        "apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"pool": POOL, "source": {"path": f"/adapters/{name}"}, "replicas": replicas, "rank": rank},
    }


def _wait(what: str, predicate, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _ready_pod_ip(kubectl: Kubectl, component: str) -> str | None:
    selector = f"kubelora.io/pool={POOL},app.kubernetes.io/component={component}"
    pods = json.loads(kubectl("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json"))["items"]
    for pod in pods:
        conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
        if conditions.get("Ready") == "True" and pod["status"].get("podIP"):
            return pod["status"]["podIP"]
    return None


def _cluster(*args: str, check: bool = True, show_progress: bool = False) -> subprocess.CompletedProcess:
    """e2e/cluster; show_progress: its stderr (build progress, a failure's component and log) goes to ours."""
    result = subprocess.run([str(REPO / "e2e" / "cluster"), *args], stdout=subprocess.PIPE,
                            stderr=None if show_progress else subprocess.PIPE, text=True, timeout=1800)
    if check and result.returncode != 0:
        said = "" if show_progress else f": {result.stderr[-2000:]}"
        raise RuntimeError(f"e2e/cluster {' '.join(args)} failed ({result.returncode}){said}")
    return result


def _bring_up_cluster() -> Kubectl:
    _step("starting the local Kubernetes control plane (built from the official sources on first use)")
    kubeconfig = _cluster("up", show_progress=True).stdout.strip().splitlines()[-1]
    return Kubectl(kubeconfig)


def _clean_up(kubectl: Kubectl, helm: str | None) -> None:
    """Leave a cluster that was already running as it was: adapters and pools first (the operator removes
    its finalizers), then the namespace and the chart release."""
    _step("removing the demo's pool, adapters, namespace and chart release")
    for kind in ("loraadapters", "lorapools"):
        kubectl("delete", kind, "--all", "-n", NAMESPACE, "--wait=true", f"--timeout={WAIT_S}s", check=False)
    kubectl("delete", "namespace", NAMESPACE, "--wait=true", f"--timeout={WAIT_S}s", check=False)
    if helm is not None:
        _run(helm, "uninstall", "kubelora", "-n", "kubelora-system", "--wait", env=kubectl.env, check=False)
        kubectl("delete", "namespace", "kubelora-system", "--wait=true", f"--timeout={WAIT_S}s", check=False)


def _build_helm() -> str:
    """The helm binary's path (its build's progress and failures print to our stderr)."""
    result = subprocess.run([str(REPO / "e2e" / "helm" / "build.sh")], stdout=subprocess.PIPE, text=True,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"e2e/helm/build.sh failed ({result.returncode}); its output is above")
    return result.stdout.strip().splitlines()[-1]


def _install_chart(kubectl: Kubectl, helm: str) -> None:
    """The operator manages only the demo's namespace (watchNamespaces: its Role is made there, so the namespace
    comes first); the chart's default would be the release namespace alone."""
    _step(f"installing the Helm chart: CRDs, operator, RBAC in namespace {NAMESPACE}")
    kubectl("create", "namespace", NAMESPACE, check=False)
    _run(helm, "upgrade", "--install", "kubelora", str(REPO / "charts" / "kubelora"), "-n", "kubelora-system",
         "--create-namespace", "--set", f"watchNamespaces={{{NAMESPACE}}}", "--wait", "--timeout", "4m",
         env=kubectl.env)


def _apply_pool_and_adapters(kubectl: Kubectl, root: Path) -> None:
    kubectl("create", "namespace", NAMESPACE, check=False)
    _step(f"kubectl apply: LoRAPool {POOL} (2 engine replicas, router) and {len(DEMO_ADAPTERS)} LoRAAdapters")
    kubectl.apply(_pool_manifest(root))
    for name, rank, _, _ in DEMO_ADAPTERS:
        kubectl.apply(_adapter_manifest(name, rank, "all" if name == EVERYWHERE else 1))
    names = [f"loraadapter/{name}" for name, *_ in DEMO_ADAPTERS]
    kubectl("wait", "-n", NAMESPACE, "--for=jsonpath={.status.phase}=Ready", *names, f"--timeout={WAIT_S}s")
    print(kubectl("get", "lorapools,loraadapters", "-n", NAMESPACE), end="")


def _call_through_router(router_ip: str) -> tuple[int, int]:
    """Every prompt to the base model and each tenant's adapter; returns (answers equal to transformers+PEFT's,
    answers)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{router_ip}:{ROUTER_PORT}/v1", api_key="demo")
    _step(f"tenants call the router at {router_ip}:{ROUTER_PORT} with the openai SDK")
    same = total = 0
    for prompt in DEMO_PROMPTS:
        for adapter in (None, *(name for name, *_ in DEMO_ADAPTERS)):
            text = client.completions.create(model=adapter or SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0.0).choices[0].text
            print_answer(adapter, prompt, text)
            same, total = same + check_answer(adapter, prompt, text), total + 1
    return same, total


def _show_unload(kubectl: Kubectl, router_ip: str) -> None:
    from openai import NotFoundError, OpenAI

    _step(f"kubectl delete loraadapter {DELETED}: the operator unloads it from its engines")
    kubectl("delete", "loraadapter", DELETED, "-n", NAMESPACE, "--wait=true", f"--timeout={WAIT_S}s")
    client = OpenAI(base_url=f"http://{router_ip}:{ROUTER_PORT}/v1", api_key="demo")

    def refused() -> str | None:
        try:
            client.completions.create(model=DELETED, prompt="hi", max_tokens=1)
        except NotFoundError as err:
            return str(err)
        return None

    print(f"   a request for {DELETED} now: {_wait(f'{DELETED} to be gone from the router', refused)}")


def run_cluster_demo(workdir: Path, keep: bool) -> int:
    if not (REPO / "e2e" / "cluster").exists():
        raise SystemExit("the cluster demo needs the repository checkout (e2e/, charts/); try --engine-only")
    global _STARTED
    _STARTED = time.monotonic()
    _step(f"the demo's tiny Llama model and {len(DEMO_ADAPTERS)} PEFT adapters "
          f"({', '.join(name for name, *_ in DEMO_ADAPTERS)}) in {workdir}")
    build_demo_material(workdir)
    was_running = _cluster("status", check=False).returncode == 0
    try:
        _step("building helm from the Go module proxy (first use only)")
        helm = _build_helm()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        _report_failure(exc, None)
        return 1
    try:
        kubectl = _bring_up_cluster()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        _report_failure(exc, None)
        if not was_running and not keep:
            _cluster("down", check=False)
        return 1
    try:
        _install_chart(kubectl, helm)
        _apply_pool_and_adapters(kubectl, workdir)
        _step("waiting for a ready router pod")
        router_ip = _wait("a ready router pod", lambda: _ready_pod_ip(kubectl, "router"))
        same, total = _call_through_router(router_ip)
        _show_unload(kubectl, router_ip)
        print(f"== {same} of {total} answers equal transformers+PEFT's")
        status = 0 if same == total else 1
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        _report_failure(exc, kubectl)
        status = 1
    finally:
        if keep:
            _step(f"left running: KUBECONFIG={kubectl.env['KUBECONFIG']} e2e/kubectl get pods -A -o wide")
        elif was_running:
            _clean_up(kubectl, helm)
        else:
            _step("stopping the cluster (e2e/cluster down)")
            _cluster("down", check=False)
    return status
