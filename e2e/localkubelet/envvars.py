"""Container environment: env, envFrom, valueFrom (ConfigMap/Secret keys, downward API)."""
from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass

from .apiclient import ApiClient, ApiError
from .fieldref import resolve_field_ref

VAR_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class EnvError(Exception):
    """A referenced ConfigMap, Secret or key is missing: CreateContainerConfigError."""


@dataclass(frozen=True)
class PodEnvContext:
    api: ApiClient
    pod: dict
    pod_ip: str
    host_ip: str
    apiserver_port: int

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]


def build_env(ctx: PodEnvContext, container: dict) -> dict[str, str]:
    env = build_base_env(ctx)
    for source in container.get("envFrom", []):
        env.update(resolve_env_from(ctx, source))
    for var in container.get("env", []):
        if "valueFrom" in var:
            value = resolve_value_from(ctx, container, var["valueFrom"])
            if value is not None:
                env[var["name"]] = value
        else:
            env[var["name"]] = expand(var.get("value", ""), env)
    return env


def build_base_env(ctx: PodEnvContext) -> dict[str, str]:
    """What a container runtime and the kubelet provide. The API server is reached at the
    node address: ClusterIPs are not routed (no kube-proxy, docs/cluster.md).
    PYTHONUNBUFFERED makes `kubectl logs` show Python output as it happens."""
    port = str(ctx.apiserver_port)
    return {
        "HOSTNAME": ctx.pod["metadata"]["name"],
        "PYTHONUNBUFFERED": "1",
        "KUBERNETES_SERVICE_HOST": ctx.host_ip,
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
        "KUBERNETES_PORT": f"tcp://{ctx.host_ip}:{port}",
    }


def resolve_env_from(ctx: PodEnvContext, source: dict) -> dict[str, str]:
    prefix = source.get("prefix", "")
    for kind, resource in (("configMapRef", "configmaps"), ("secretRef", "secrets")):
        if kind in source:
            data = fetch_data(ctx, resource, source[kind]["name"], source[kind].get("optional"))
            return {prefix + key: value for key, value in data.items()}
    raise EnvError(f"envFrom: unsupported source {sorted(source)}")


def resolve_value_from(ctx: PodEnvContext, container: dict, value_from: dict) -> str | None:
    if "fieldRef" in value_from:
        return resolve_field_ref(ctx.pod, value_from["fieldRef"]["fieldPath"], ctx.pod_ip,
                                 ctx.host_ip)
    for kind, resource in (("configMapKeyRef", "configmaps"), ("secretKeyRef", "secrets")):
        if kind in value_from:
            ref = value_from[kind]
            data = fetch_data(ctx, resource, ref["name"], ref.get("optional"))
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise EnvError(f"{resource} {ref['name']!r} has no key {ref['key']!r}")
            return data[ref["key"]]
    if "resourceFieldRef" in value_from:
        return resolve_resource_field(container, value_from["resourceFieldRef"])
    raise EnvError(f"valueFrom: unsupported source {sorted(value_from)}")


def fetch_data(ctx: PodEnvContext, resource: str, name: str, is_optional: bool | None) -> dict:
    try:
        obj = ctx.api.get(f"/api/v1/namespaces/{ctx.namespace}/{resource}/{name}")
    except ApiError as error:
        if error.status == 404 and is_optional:
            return {}
        raise EnvError(f"{resource} {name!r}: {error}") from error
    data = obj.get("data", {})
    if resource == "secrets":
        return {key: base64.b64decode(value).decode() for key, value in data.items()}
    return data


def resolve_resource_field(container: dict, ref: dict) -> str:
    """limits.* / requests.* of this container; a missing limit reads as 0 here, where a
    real kubelet would substitute node allocatable."""
    section, _, name = ref["resource"].partition(".")
    raw = container.get("resources", {}).get(section, {}).get(name, "0")
    return str(math.ceil(parse_quantity(raw) / parse_quantity(ref.get("divisor", "1"))))


def parse_quantity(text: str) -> float:
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20,
                "Gi": 2**30, "Ti": 2**40}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if str(text).endswith(suffix):
            return float(str(text)[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined names are replaced, $$ escapes, the rest stays."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return VAR_REFERENCE.sub(replace, text)
