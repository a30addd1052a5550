"""Fixtures for the operator's end-to-end tests on the local cluster (docs/cluster.md).

The operator runs in the cluster as a Deployment (image `kubelora-operator:<version>`, as `make images` builds
it), watching one test namespace, with the test's RBAC. Tiny model and adapters are
written to a temporary directory that engine pods mount as hostPath volumes.
"""
from __future__ import annotations

import functools
import http.server
import json
import string
import sys
import threading
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit
from dataclasses import dataclass
from pathlib import Path

import pytest

# --import-mode=importlib and -P: neither the repo root nor e2e/ is on sys.path by default.
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "e2e"))

from pytest_cluster import LocalCluster, cluster  # noqa: E402,F401  (cluster: a fixture)

from kubelora.operator.settings import VERSION  # noqa: E402  (the images' tag, as make images builds them)

MANIFESTS = Path(__file__).resolve().parent / "manifests"


@dataclass(frozen=True)
class Material:
    root: Path
    model_dir: Path
    adapters_dir: Path


def pool_manifest(name: str, material: Material, *, replicas: int = 1, router: bool = False, max_loras: int = 2,
                  max_cpu_loras: int = 4, **spec) -> str:
    """A LoRAPool of the tiny model on CPU engines, its adapters under /adapters (`spec` adds or replaces fields).
    JSON, which kubectl reads as YAML."""
    body = {"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAPool", "metadata": {"name": name}, "spec": {
        "model": {"path": "/models/tiny", "servedName": "tiny"},
        "modelVolume": {"hostPath": str(material.model_dir.parent), "mountPath": "/models"},
        "adapterVolume": {"hostPath": str(material.adapters_dir), "mountPath": "/adapters"},
        "adapterRoots": ["/adapters"], "replicas": replicas, "router": {"enabled": router, "replicas": 1},
        "engine": {"device": "cpu", "maxLoras": max_loras, "maxLoraRank": 8, "maxCpuLoras": max_cpu_loras,
                   "maxModelLen": 256, "maxNumSeqs": 8},
        **spec}}
    return json.dumps(body)


def adapter_manifest(name: str, pool: str, path: str, replicas: int | str = 1) -> str:
    return json.dumps({"apiVersion": "kubelora.io/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": name},
                       "spec": {"pool": pool, "source": {"path": path}, "replicas": replicas}})


@pytest.fixture(scope="session")
def material(tmp_path_factory: pytest.TempPathFactory) -> Material:
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("operator-e2e")
    root.chmod(0o755)
    model_dir = make_tiny_model(root / "models" / "tiny")
    adapters = root / "adapters"
    for name, rank, seed in (("a1", 4, 1), ("a2", 8, 2), ("a2v2", 8, 22), ("big", 16, 3)):
        make_adapter(adapters / name, model_dir, rank=rank, seed=seed)
    return Material(root=root, model_dir=model_dir, adapters_dir=adapters)


@pytest.fixture(scope="module")
def adapter_server(cluster: LocalCluster, material: Material) -> Iterator[str]:
    """An HTTP server on the host serving the adapters directory; pods reach the host at the bridge address
    (the API server's address in the kubeconfig). Yields `host:port`."""
    host = next(urlsplit(line.split()[-1]).hostname for line in cluster.kubeconfig.read_text().splitlines()
                if line.strip().startswith("server:"))
    handler = functools.partial(QuietHandler, directory=str(material.adapters_dir))
    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


SOURCE_TOKEN = "e2e-source-token"


@pytest.fixture
def source_token() -> str:
    """The bearer token adapter_server wants for its /private/ URLs."""
    return SOURCE_TOKEN


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """The adapters directory; under /private/ the same files, for a bearer token only."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's hook
        if self.path.startswith("/private/"):
            if self.headers.get("Authorization") != f"Bearer {SOURCE_TOKEN}":
                self.send_error(401, "a bearer token is required")
                return
            self.path = self.path[len("/private"):]
        super().do_GET()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass


@dataclass(frozen=True)
class OperatorEnv:
    cluster: LocalCluster
    namespace: str  # where pools and adapters live
    operator_namespace: str


def _delete_kubelora_objects(cluster: LocalCluster, namespace: str) -> None:
    """Adapters and pools first, while the operator still runs to remove its finalizers; if it cannot (a
    failed test may have broken it), the finalizers are dropped so that the namespace can go."""
    for kind in ("loraadapters", "lorapools"):
        cluster.kubectl("delete", kind, "--all", "-n", namespace, "--wait=true", "--timeout=30s", check=False,
                        timeout_s=60)
    left = cluster.kubectl("get", "loraadapters,lorapools", "-n", namespace, "-o", "name", check=False)
    for name in left.stdout.split():
        cluster.kubectl("patch", name, "-n", namespace, "--type=merge", "-p", '{"metadata": {"finalizers": null}}',
                        check=False)


@pytest.fixture(scope="module")
def operator_env(cluster: LocalCluster) -> Iterator[OperatorEnv]:
    suffix = uuid.uuid4().hex[:6]
    env = OperatorEnv(cluster, f"kl-e2e-{suffix}", f"kl-op-{suffix}")
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/lorapools.kubelora.io",
                    "crd/loraadapters.kubelora.io", "--timeout=30s")
    for namespace in (env.namespace, env.operator_namespace):
        cluster.kubectl("create", "namespace", namespace)
    manifest = string.Template((MANIFESTS / "operator.yaml").read_text()).substitute(
        NAMESPACE=env.operator_namespace, WATCH_NAMESPACE=env.namespace, VERSION=VERSION)
    cluster.apply(manifest)
    try:
        cluster.kubectl("rollout", "status", "-n", env.operator_namespace, "deployment/kubelora-operator",
                        "--timeout=90s", timeout_s=100)
        yield env
    finally:
        _delete_kubelora_objects(cluster, env.namespace)
        cluster.kubectl("delete", "namespace", env.namespace, env.operator_namespace, "--wait=true",
                        "--timeout=90s", check=False, timeout_s=120)
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", "kubelora-operator-e2e", check=False)
