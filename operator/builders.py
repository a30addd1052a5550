"""Pure manifest builders: a PoolSpec (and its owner reference) in, Kubernetes objects out.

Every object carries the pool's owner reference, so deleting the pool garbage-collects them. A pool that names
no engine or router image gets the operator's own (`DefaultImages`, from its settings). Engines are closed by
default (docs/operator.md): an admin token from a Secret, and a NetworkPolicy on their two ports.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

from kubelora.operator import names
from kubelora.operator.settings import DefaultImages, NetworkPolicySettings
from kubelora.operator.specs import PoolSpec, Volume

Manifest = dict[str, Any]


def build_owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {"apiVersion": body.get("apiVersion", names.API_VERSION), "kind": body.get("kind", "LoRAPool"),
            "name": meta["name"], "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def _metadata(pool: PoolSpec, name: str, component: str, owner: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace, "labels": names.pool_labels(pool.name, component),
            "ownerReferences": [owner]}


def build_engine_args(pool: PoolSpec) -> list[str]:
    """`kubelora engine serve` flags for the pool's settings (docs/server.md)."""
    engine = pool.engine
    args = ["engine", "serve", "--model", pool.model_path, "--served-model-name", pool.served_name,
            "--max-loras", str(engine.max_loras), "--max-lora-rank", str(engine.max_lora_rank),
            "--max-cpu-loras", str(engine.max_cpu_loras), "--max-model-len", str(engine.max_model_len),
            "--device", engine.device, "--host", "0.0.0.0", "--port", str(names.ENGINE_PORT),
            "--admin-port", str(names.ENGINE_ADMIN_PORT)]
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.dtype is not None:
        args += ["--dtype", engine.dtype]
    for root in pool.adapter_roots:
        args += ["--adapter-root", root]
    for host in pool.adapter_url_hosts:
        args += ["--adapter-url-host", host]
    for bucket in pool.adapter_s3_buckets:
        args += ["--adapter-s3-bucket", bucket]
    for endpoint in pool.adapter_s3_endpoints:
        args += ["--adapter-s3-endpoint", endpoint]
    if pool.require_api_keys:
        args.append("--require-api-keys")
    return args + list(engine.extra_args)


def _volume(name: str, volume: Volume) -> tuple[dict[str, Any], dict[str, Any]]:
    if volume.host_path is not None:
        source: dict[str, Any] = {"hostPath": {"path": volume.host_path, "type": "Directory"}}
    else:
        source = {"persistentVolumeClaim": {"claimName": volume.claim_name, "readOnly": volume.is_read_only}}
    mount = {"name": name, "mountPath": volume.mount_path, "readOnly": volume.is_read_only}
    return {"name": name, **source}, mount


def _http_probe(path: str, period_s: int, failure_threshold: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": names.ENGINE_PORT}, "periodSeconds": period_s,
            "timeoutSeconds": 5, "failureThreshold": failure_threshold}


def build_engine_container(pool: PoolSpec, images: DefaultImages = DefaultImages()) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "engine", "image": pool.image or images.engine, "args": build_engine_args(pool),
        "ports": [{"name": "http", "containerPort": names.ENGINE_PORT, "protocol": "TCP"},
                  {"name": "admin", "containerPort": names.ENGINE_ADMIN_PORT, "protocol": "TCP"}],
        # /health answers while the model loads (liveness); /ready once it serves (readiness).
        "livenessProbe": _http_probe("/health", period_s=10, failure_threshold=3),
        "readinessProbe": _http_probe("/ready", period_s=2, failure_threshold=2),
        "env": [{"name": "KUBELORA_LOG_LEVEL", "value": "info"}],
    }
    if pool.admin_token is not None:
        container["env"].append({"name": "KUBELORA_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": pool.admin_token.name, "key": pool.admin_token.key}}})
    if pool.resources:
        container["resources"] = pool.resources
    if pool.image_pull_policy:
        container["imagePullPolicy"] = pool.image_pull_policy
    return container


ADMIN_TOKEN_BYTES = 32  # a generated admin token's randomness (secrets.token_urlsafe)


def admin_token_digest(token: str | None) -> str | None:
    """What the engine pod template records of the admin token: 16 hex digits of its SHA-256 (None: no token)."""
    return None if token is None else hashlib.sha256(token.encode()).hexdigest()[:16]


def build_engine_deployment(pool: PoolSpec, owner: dict[str, Any], images: DefaultImages = DefaultImages(),
                            token_digest: str | None = None) -> Manifest:
    """token_digest (`admin_token_digest`): recorded on the pod template, so a new or rotated token in the admin
    Secret rolls the pods, which read it into their environment only at start."""
    container = build_engine_container(pool, images)
    volumes, mounts = [], []
    for name, volume in (("model", pool.model_volume), ("adapters", pool.adapter_volume)):
        if volume is not None:
            pod_volume, mount = _volume(name, volume)
            volumes.append(pod_volume)
            mounts.append(mount)
    if mounts:
        container["volumeMounts"] = mounts
    selector = names.engine_selector(pool.name)
    pod_spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 30}
    if volumes:
        pod_spec["volumes"] = volumes
    if pool.node_selector:
        pod_spec["nodeSelector"] = pool.node_selector
    if pool.tolerations:
        pod_spec["tolerations"] = list(pool.tolerations)
    annotations = {names.ANNOTATION_POOL_SPEC: pool.fingerprint}
    if token_digest is not None:
        annotations[names.ANNOTATION_ADMIN_TOKEN] = token_digest
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(pool, names.engine_name(pool.name), "engine", owner),
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": {**pool.pod_labels, **names.pool_labels(pool.name, "engine")},
                                      "annotations": annotations},
                         "spec": pod_spec},
        },
    }


def build_engine_service(pool: PoolSpec, owner: dict[str, Any]) -> Manifest:
    """Headless: one address per engine pod (the router and the operator go by pod IP)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(pool, names.engine_name(pool.name), "engine", owner),
        "spec": {"clusterIP": "None", "selector": names.engine_selector(pool.name), "publishNotReadyAddresses": False,
                 "ports": [{"name": "http", "port": names.ENGINE_PORT, "targetPort": names.ENGINE_PORT}]},
    }


def build_admin_token_secret(pool: PoolSpec, owner: dict[str, Any], token: str | None = None,
                             previous: Mapping[str, str] | None = None) -> Manifest:
    """The pool's engine admin token (when its spec names none), owned by the pool: created when missing (at the
    pool's creation, or after someone deleted it: then the engine Deployment's token digest changes and its pods
    roll onto the new token), never overwritten. token: ADMIN_TOKEN_BYTES random bytes unless given (tests).
    previous: digest -> token of the tokens pods of the pool still run with (names.PREVIOUS_TOKEN_PREFIX)."""
    token = secrets.token_urlsafe(ADMIN_TOKEN_BYTES) if token is None else token
    data = {names.ADMIN_TOKEN_KEY: token}
    data.update({names.PREVIOUS_TOKEN_PREFIX + digest: old for digest, old in (previous or {}).items()
                 if old != token})
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _metadata(pool, names.admin_token_secret_name(pool.name), "engine", owner),
        "stringData": data,
    }


# Set by the API server on every namespace (Kubernetes >= 1.21): a namespace selector by name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def build_network_policy(pool: PoolSpec, owner: dict[str, Any], network: NetworkPolicySettings) -> Manifest:
    """Ingress of the pool's engine pods: the admin port from the operator's pods only; the serving port from
    the pool's routers (with no router: every pod of the pool's namespace, whom the pool Service serves) and
    from the namespaces in spec.allowedClientNamespaces. Nothing else (a NetworkPolicy that selects a pod
    refuses every ingress it does not allow)."""
    operator_peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(network.operator_pod_labels)}}
    operator_peer["namespaceSelector"] = (
        {"matchLabels": {NAMESPACE_NAME_LABEL: network.operator_namespace}} if network.operator_namespace else {})
    clients: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": {names.LABEL_POOL: pool.name, names.LABEL_COMPONENT: "router"}}}
        if pool.router.is_enabled
        else {"podSelector": {}}]
    clients += [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}}
                for namespace in pool.allowed_client_namespaces]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _metadata(pool, names.network_policy_name(pool.name), "engine", owner),
        "spec": {
            "podSelector": {"matchLabels": names.engine_selector(pool.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [operator_peer], "ports": [{"protocol": "TCP", "port": names.ENGINE_ADMIN_PORT}]},
                {"from": clients, "ports": [{"protocol": "TCP", "port": names.ENGINE_PORT}]},
            ],
        },
    }


def build_pool_service(pool: PoolSpec, owner: dict[str, Any]) -> Manifest:
    """The address clients use: the router when enabled, else the engine pods directly."""
    component = "router" if pool.router.is_enabled else "engine"
    port = names.ROUTER_PORT if pool.router.is_enabled else names.ENGINE_PORT
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(pool, pool.name, "pool", owner),
        "spec": {"selector": {names.LABEL_POOL: pool.name, names.LABEL_COMPONENT: component},
                 "ports": [{"name": "http", "port": port, "targetPort": port}]},
    }


def build_router_rbac(pool: PoolSpec, owner: dict[str, Any]) -> list[Manifest]:
    """The router reads its pool's placement ConfigMap, by name, with `get` (and nothing else)."""
    name = names.router_name(pool.name)
    rule = {"apiGroups": [""], "resources": ["configmaps"],
            "resourceNames": [names.placement_configmap_name(pool.name)], "verbs": ["get"]}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(pool, name, "router", owner)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": _metadata(pool, name, "router", owner), "rules": [rule]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _metadata(pool, name, "router", owner),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}]},
    ]


def build_router_deployment(pool: PoolSpec, owner: dict[str, Any],
                            images: DefaultImages = DefaultImages()) -> Manifest:
    name = names.router_name(pool.name)
    labels = names.pool_labels(pool.name, "router")
    container = {
        "name": "router", "image": pool.router.image or images.router,
        # "--": the top-level `kubelora` parser passes options after `router` on only behind it (docs/router.md).
        "args": ["router", "--", "--pool", pool.name, "--namespace", pool.namespace, "--placement-configmap",
                 names.placement_configmap_name(pool.name), "--port", str(names.ROUTER_PORT)],
        "ports": [{"name": "http", "containerPort": names.ROUTER_PORT, "protocol": "TCP"}],
        "livenessProbe": {"httpGet": {"path": "/health", "port": names.ROUTER_PORT}, "periodSeconds": 10},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": names.ROUTER_PORT}, "periodSeconds": 2},
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(pool, name, "router", owner),
        "spec": {"replicas": pool.router.replicas,
                 "selector": {"matchLabels": {names.LABEL_POOL: pool.name, names.LABEL_COMPONENT: "router"}},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"serviceAccountName": name, "containers": [container]}}},
    }


def build_pool_manifests(pool: PoolSpec, owner: dict[str, Any], images: DefaultImages = DefaultImages(),
                         network: NetworkPolicySettings | None = None,
                         admin_token: str | None = None) -> list[Manifest]:
    """Everything a pool owns except the placement ConfigMap (written by the reconcile) and the admin token
    Secret (created when missing, build_admin_token_secret); the NetworkPolicy when `network` is enabled.
    admin_token: the token the engines are to read (its digest goes on their pod template)."""
    manifests = [build_engine_deployment(pool, owner, images, admin_token_digest(admin_token)),
                 build_engine_service(pool, owner),
                 build_pool_service(pool, owner)]
    if network is not None and network.is_enabled:
        manifests.append(build_network_policy(pool, owner, network))
    if pool.router.is_enabled:
        manifests += build_router_rbac(pool, owner) + [build_router_deployment(pool, owner, images)]
    return manifests


def build_router_manifest_keys(pool: PoolSpec) -> list[tuple[str, str]]:
    """(kind, name) of the router objects, deleted when the router is switched off."""
    name = names.router_name(pool.name)
    return [("Deployment", name), ("RoleBinding", name), ("Role", name), ("ServiceAccount", name)]


def build_placement_configmap(pool: PoolSpec, owner: dict[str, Any], placement: dict[str, Any]) -> Manifest:
    """The router's contract (docs/architecture.md): key placement.json, JSON written only here."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _metadata(pool, names.placement_configmap_name(pool.name), "placement", owner),
        "data": {"placement.json": json.dumps(placement, sort_keys=True, separators=(",", ":"))},
    }
