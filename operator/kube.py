"""The operator's Kubernetes API client besides kopf: async (aiohttp), JSON dicts in and out.

Everything the reconcile and the leader election write or read outside kopf's watches goes through `Kube`:
server-side apply of the `build_*` manifests (unchanged dicts), gets, deletes, pods, Secrets, custom objects,
status patches, events, and the election's Lease. Credentials come from kopf's own login helpers.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

from kubelora.operator import names

# kind -> (API path prefix, plural); every kind the operator applies, reads or deletes by name.
KINDS = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Secret": ("/api/v1", "secrets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
}
CUSTOM_PREFIX = f"/apis/{names.GROUP}/{names.VERSION}"
DEFAULT_TIMEOUT_S = 30.0


def micro_time_now() -> str:
    """Now as the API's MicroTime (RFC 3339, microseconds, UTC)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class KubeConnection:
    server: str  # https://host:port
    ssl_context: ssl.SSLContext | bool  # False: plain HTTP or no verification
    headers: dict[str, str]  # Authorization, when the credentials have one


def load_connection() -> KubeConnection:
    """The pod's service account first, then the kubeconfig, through kopf's login helpers. In a pod the server is
    the API service's address from KUBERNETES_SERVICE_HOST/PORT (as client-go's in-cluster config), so that no
    cluster DNS is needed. Raises kopf.LoginError when neither is there."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is not None and host and port:
        info = dataclasses.replace(info, server=f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}")
    if info is None:
        info = kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no Kubernetes credentials: neither a pod service account nor a kubeconfig")
    return KubeConnection(info.server, info.as_ssl_context(), info.as_http_headers())


class Kube:
    """`timeout_s` bounds each request (the leader election's are shorter than a reconcile's)."""

    def __init__(self, connection: KubeConnection, session: aiohttp.ClientSession,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._conn = connection
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def request(self, method: str, path: str, body: Any = None, *, params: dict | None = None,
                      content_type: str = "application/json") -> dict:
        headers = {**self._conn.headers, "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._session.request(method, self._conn.server + path, data=data, params=params,
                                         headers=headers, ssl=self._conn.ssl_context,
                                         timeout=self._timeout) as response:
            text = await response.text()
            if response.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise KubeError(response.status, message)
            return json.loads(text) if text else {}

    @staticmethod
    def object_path(kind: str, namespace: str, name: str = "") -> str:
        prefix, plural = KINDS[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        return f"{path}/{quote(name)}" if name else path

    async def apply(self, manifest: dict) -> dict:
        """Server-side apply, this operator as the field manager (forcing: it owns these objects)."""
        meta = manifest["metadata"]
        path = self.object_path(manifest["kind"], meta["namespace"], meta["name"])
        return await self.request("PATCH", path, manifest, params={"fieldManager": names.FIELD_MANAGER,
                                                                   "force": "true"},
                                  content_type="application/apply-patch+yaml")

    async def create(self, manifest: dict) -> bool:
        """Create the object unless one of its name exists (False then; the existing one is left as it is)."""
        meta = manifest["metadata"]
        try:
            await self.request("POST", self.object_path(manifest["kind"], meta["namespace"]), manifest)
            return True
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise

    async def replace(self, manifest: dict) -> dict:
        """PUT of the whole object; its metadata.resourceVersion makes a write in between a 409 KubeError."""
        meta = manifest["metadata"]
        return await self.request("PUT", self.object_path(manifest["kind"], meta["namespace"], meta["name"]),
                                  manifest)

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        try:
            await self.request("DELETE", self.object_path(kind, namespace, name))
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return await self.request("GET", self.object_path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list_pods(self, namespace: str, selector: str) -> list[dict]:
        body = await self.request("GET", f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector})
        return body.get("items", [])

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        data = await self.read_secret_data(namespace, name)
        return None if data is None else data.get(key)

    async def read_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """The Secret's keys, decoded and stripped; None when there is no such Secret."""
        secret = await self.get("Secret", namespace, name)
        if secret is None:
            return None
        return {key: base64.b64decode(value).decode().strip() for key, value in (secret.get("data") or {}).items()}

    async def list_custom(self, plural: str, namespace: str) -> list[dict]:
        body = await self.request("GET", f"{CUSTOM_PREFIX}/namespaces/{namespace}/{plural}")
        return body.get("items", [])

    async def get_custom(self, plural: str, namespace: str, name: str) -> dict | None:
        try:
            return await self.request("GET", f"{CUSTOM_PREFIX}/namespaces/{namespace}/{plural}/{quote(name)}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def patch_status(self, plural: str, namespace: str, name: str, status: dict) -> None:
        """Merge patch of the status subresource; a gone object is fine (it was deleted meanwhile)."""
        path = f"{CUSTOM_PREFIX}/namespaces/{namespace}/{plural}/{quote(name)}/status"
        try:
            await self.request("PATCH", path, {"status": status}, content_type="application/merge-patch+json")
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def create_event(self, involved: dict, event_type: str, reason: str, message: str) -> None:
        meta = involved["metadata"]
        now = micro_time_now()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": involved.get("apiVersion", names.API_VERSION),
                               "kind": involved["kind"], "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid")},
            "type": event_type, "reason": reason, "message": message[:1024],
            "source": {"component": names.FIELD_MANAGER}, "reportingComponent": names.FIELD_MANAGER,
            "reportingInstance": names.FIELD_MANAGER,
            "firstTimestamp": now, "lastTimestamp": now, "eventTime": now, "action": reason, "count": 1,
        }
        try:
            await self.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", event)
        except KubeError:
            pass  # events are best effort: a lost event must never fail a reconcile
