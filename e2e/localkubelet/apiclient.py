"""A minimal, thread-safe Kubernetes REST client (standard library only)."""
from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


@dataclass(frozen=True)
class TlsIdentity:
    ca: str
    client_cert: str
    client_key: str

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.client_cert, self.client_key)
        return context


class ApiClient:
    """One connection per request: simple and safe from any thread; the API is local."""

    def __init__(self, server: str, identity: TlsIdentity, timeout_s: float = 15.0) -> None:
        parsed = urllib.parse.urlsplit(server)
        self._host, self._port = parsed.hostname or "", parsed.port or 443
        self._context = identity.client_context()
        self._timeout_s = timeout_s

    def request(self, method: str, path: str, body: object = None,
                content_type: str = "application/json") -> dict:
        """The answer's JSON; ApiError for an HTTP error status, OSError when the API server cannot be reached
        or cuts the answer off (callers that must survive an outage catch both)."""
        connection = http.client.HTTPSConnection(self._host, self._port, context=self._context,
                                                 timeout=self._timeout_s)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Accept": "application/json", "Content-Type": content_type}
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            text = response.read().decode()
        except http.client.HTTPException as error:  # a cut or garbled answer (the API server going down)
            raise ConnectionError(f"{method} {path}: {type(error).__name__}: {error}") from error
        finally:
            connection.close()
        if response.status >= 300:
            raise ApiError(response.status, text)
        return json.loads(text) if text else {}

    def get(self, path: str) -> dict:
        return self.request("GET", path)

    def post(self, path: str, body: object) -> dict:
        return self.request("POST", path, body)

    def put(self, path: str, body: object) -> dict:
        return self.request("PUT", path, body)

    def patch(self, path: str, body: object, content_type: str = MERGE_PATCH) -> dict:
        return self.request("PATCH", path, body, content_type)

    def delete(self, path: str, body: object = None) -> dict:
        return self.request("DELETE", path, body)


def query(**params: object) -> str:
    return "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
