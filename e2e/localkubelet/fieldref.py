"""Downward API field paths, shared by env vars and downwardAPI volumes."""
from __future__ import annotations

import re

LABEL_OR_ANNOTATION = re.compile(r"metadata\.(labels|annotations)\['(.+)'\]$")


def resolve_field_ref(pod: dict, field_path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
        "metadata.labels": format_map(meta.get("labels", {})),
        "metadata.annotations": format_map(meta.get("annotations", {})),
    }
    if field_path in simple:
        return simple[field_path]
    match = LABEL_OR_ANNOTATION.match(field_path)
    if match:
        return meta.get(match.group(1), {}).get(match.group(2), "")
    raise ValueError(f"unsupported fieldRef.fieldPath {field_path!r}")


def format_map(values: dict[str, str]) -> str:
    """The kubelet's format for whole label/annotation maps: key="value" per line."""
    return "\n".join(f'{key}="{value}"' for key, value in sorted(values.items()))
