"""A small async Kubernetes API client (aiohttp, JSON dicts) for what the reconcile needs.

Credentials come from the `kubernetes` package's loaders (in-cluster first, then kubeconfig), as kopf's
own login does; requests carry plain dicts, so manifests from `build_*` go out unchanged.
"""

from __future__ import annotations

import datetime as dt
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from kubelora.operator import names

# kind -> (API path prefix, plural); every kind the operator applies or deletes.
KINDS = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Secret": ("/api/v1", "secrets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
}
CUSTOM_PREFIX = f"/apis/{names.GROUP}/{names.VERSION}"


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class KubeConnection:
    server: str
    ssl_context: ssl.SSLContext | bool
    token: str | None


def load_connection() -> KubeConnection:
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    config = kubernetes.client.Configuration.get_default_copy()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    token = header.split(" ", 1)[-1] if header else None
    if not config.verify_ssl:
        return KubeConnection(config.host, False, token)
    context = ssl.create_default_context(cafile=config.ssl_ca_cert)
    if config.cert_file:
        context.load_cert_chain(config.cert_file, config.key_file)
    return KubeConnection(config.host, context, token)


class Kube:
    def __init__(self, connection: KubeConnection, session: aiohttp.ClientSession) -> None:
        self._conn = connection
        self._session = session
        self._headers = {"Authorization": f"Bearer {connection.token}"} if connection.token else {}

    async def request(self, method: str, path: str, body: Any = None, *, params: dict | None = None,
                      content_type: str = "application/json") -> dict:
        headers = {**self._headers, "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._session.request(method, self._conn.server + path, data=data, params=params,
                                         headers=headers, ssl=self._conn.ssl_context,
                                         timeout=aiohttp.ClientTimeout(total=30)) as response:
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
        import base64

        try:
            secret = await self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{quote(name)}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
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
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
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
