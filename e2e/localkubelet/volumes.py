"""Pod volumes as host directories: emptyDir, hostPath, configMap, secret, projected,
downwardAPI and persistentVolumeClaim (bound to a hostPath/local PV by the provisioner).

Contents are written once when the pod starts; later ConfigMap/Secret edits and token
rotation are not propagated (docs/cluster.md, gaps).
"""
from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path

from .apiclient import ApiClient, ApiError
from .fieldref import resolve_field_ref

DEFAULT_FILE_MODE = 0o644
TOKEN_EXPIRATION_S = 3607  # what the real kubelet requests for kube-api-access volumes


class VolumeError(Exception):
    """A volume cannot be prepared yet (missing ConfigMap, unbound claim...)."""


class VolumeContext:
    def __init__(self, api: ApiClient, pod: dict, pod_dir: Path, host_ip: str) -> None:
        self.api = api
        self.pod = pod
        self.pod_dir = pod_dir
        self.host_ip = host_ip

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]


def prepare_volumes(ctx: VolumeContext) -> dict[str, Path]:
    """Materialise every volume of the pod; returns volume name -> host path."""
    return {volume["name"]: prepare_volume(ctx, volume)
            for volume in ctx.pod["spec"].get("volumes", [])}


def prepare_volume(ctx: VolumeContext, volume: dict) -> Path:
    for kind, handler in VOLUME_HANDLERS.items():
        if kind in volume:
            return handler(ctx, volume["name"], volume[kind] or {})
    raise VolumeError(f"volume {volume['name']!r}: unsupported type {sorted(volume)}")


def prepare_empty_dir(ctx: VolumeContext, name: str, source: dict) -> Path:
    # medium: Memory is served from disk too; sizeLimit is not enforced.
    return fresh_dir(ctx.pod_dir / "volumes" / "empty-dir" / name, keep=True)


def prepare_host_path(ctx: VolumeContext, name: str, source: dict) -> Path:
    path = Path(source["path"])
    kind = source.get("type", "")
    if kind in ("DirectoryOrCreate",):
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    elif kind in ("Directory", "File") and not path.exists():
        raise VolumeError(f"hostPath {path} does not exist")
    return path


def prepare_config_map(ctx: VolumeContext, name: str, source: dict) -> Path:
    target = fresh_dir(ctx.pod_dir / "volumes" / "configmap" / name)
    write_config_map(ctx, target, source)
    return target


def prepare_secret(ctx: VolumeContext, name: str, source: dict) -> Path:
    target = fresh_dir(ctx.pod_dir / "volumes" / "secret" / name)
    write_secret(ctx, target, {**source, "name": source.get("secretName", "")})
    return target


def prepare_downward_api(ctx: VolumeContext, name: str, source: dict) -> Path:
    target = fresh_dir(ctx.pod_dir / "volumes" / "downward-api" / name)
    write_downward_api(ctx, target, source, source.get("defaultMode", DEFAULT_FILE_MODE))
    return target


def prepare_projected(ctx: VolumeContext, name: str, source: dict) -> Path:
    target = fresh_dir(ctx.pod_dir / "volumes" / "projected" / name)
    mode = source.get("defaultMode", DEFAULT_FILE_MODE)
    for projection in source.get("sources", []):
        if "serviceAccountToken" in projection:
            write_token(ctx, target, projection["serviceAccountToken"], mode)
        elif "configMap" in projection:
            write_config_map(ctx, target, {"defaultMode": mode, **projection["configMap"]})
        elif "secret" in projection:
            write_secret(ctx, target, {"defaultMode": mode, **projection["secret"]})
        elif "downwardAPI" in projection:
            write_downward_api(ctx, target, projection["downwardAPI"], mode)
        else:
            raise VolumeError(f"projected volume {name!r}: unsupported source {sorted(projection)}")
    return target


def prepare_claim(ctx: VolumeContext, name: str, source: dict) -> Path:
    claim = ctx.api.get(f"/api/v1/namespaces/{ctx.namespace}/persistentvolumeclaims/"
                        f"{source['claimName']}")
    volume_name = claim.get("spec", {}).get("volumeName")
    if not volume_name:
        raise VolumeError(f"claim {source['claimName']!r} is not bound")
    spec = ctx.api.get(f"/api/v1/persistentvolumes/{volume_name}")["spec"]
    local = spec.get("hostPath") or spec.get("local")
    if not local:
        raise VolumeError(f"volume {volume_name!r} is neither hostPath nor local")
    path = Path(local["path"])
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_config_map(ctx: VolumeContext, target: Path, source: dict) -> None:
    data = fetch_optional(ctx, "configmaps", source)
    files = {k: v.encode() for k, v in data.get("data", {}).items()}
    files.update({k: base64.b64decode(v) for k, v in data.get("binaryData", {}).items()})
    write_items(target, files, source.get("items"), source.get("defaultMode", DEFAULT_FILE_MODE))


def write_secret(ctx: VolumeContext, target: Path, source: dict) -> None:
    data = fetch_optional(ctx, "secrets", source)
    files = {k: base64.b64decode(v) for k, v in data.get("data", {}).items()}
    write_items(target, files, source.get("items"), source.get("defaultMode", DEFAULT_FILE_MODE))


def fetch_optional(ctx: VolumeContext, resource: str, source: dict) -> dict:
    try:
        return ctx.api.get(f"/api/v1/namespaces/{ctx.namespace}/{resource}/{source['name']}")
    except ApiError as error:
        if error.status == 404 and source.get("optional"):
            return {}
        raise VolumeError(f"{resource} {source['name']!r}: {error}") from error


def write_items(target: Path, files: dict[str, bytes], items: list | None, mode: int) -> None:
    selected = {i["path"]: (files[i["key"]], i.get("mode", mode)) for i in items} if items \
        else {key: (content, mode) for key, content in files.items()}
    for relative, (content, file_mode) in selected.items():
        write_file(target / relative, content, file_mode)


def write_downward_api(ctx: VolumeContext, target: Path, source: dict, mode: int) -> None:
    for item in source.get("items", []):
        if "fieldRef" not in item:
            raise VolumeError("downwardAPI: only fieldRef items are supported")
        value = resolve_field_ref(ctx.pod, item["fieldRef"]["fieldPath"], "", ctx.host_ip)
        write_file(target / item["path"], value.encode(), item.get("mode", mode))


def write_token(ctx: VolumeContext, target: Path, source: dict, mode: int) -> None:
    """A bound token from the TokenRequest API, as the real kubelet does for the
    kube-api-access volume the ServiceAccount admission plugin adds to every pod."""
    pod_meta = ctx.pod["metadata"]
    account = ctx.pod["spec"].get("serviceAccountName", "default")
    spec = {"expirationSeconds": source.get("expirationSeconds", TOKEN_EXPIRATION_S),
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod_meta["name"],
                               "uid": pod_meta["uid"]}}
    if source.get("audience"):
        spec["audiences"] = [source["audience"]]
    response = ctx.api.post(f"/api/v1/namespaces/{ctx.namespace}/serviceaccounts/{account}/token",
                            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": spec})
    write_file(target / source["path"], response["status"]["token"].encode(), mode)


def write_file(path: Path, content: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    os.chmod(path, mode)


def fresh_dir(path: Path, keep: bool = False) -> Path:
    """Recreate generated content on every pod start; emptyDir survives container restarts
    because volumes are prepared once per pod, not per container."""
    if path.exists() and not keep:
        for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            child.rmdir() if child.is_dir() else child.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


VOLUME_HANDLERS: dict[str, Callable[[VolumeContext, str, dict], Path]] = {
    "emptyDir": prepare_empty_dir,
    "hostPath": prepare_host_path,
    "configMap": prepare_config_map,
    "secret": prepare_secret,
    "downwardAPI": prepare_downward_api,
    "projected": prepare_projected,
    "persistentVolumeClaim": prepare_claim,
}
