"""Health checks against the control plane, with the admin client certificate."""
from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .errors import ClusterError, tail


def admin_context(pki: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return context


def get_json(url: str, context: ssl.SSLContext | None = None) -> dict:
    with urllib.request.urlopen(url, context=context, timeout=5) as response:
        return json.loads(response.read() or b"{}")


def get_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until(what: str, check: Callable[[], bool], timeout_s: float,
               is_alive: Callable[[], bool] = lambda: True, log_path: Path | None = None) -> None:
    """Poll `check` until it holds; fail early when the process behind it died. The failure names `what` and the
    log to read (`log_path`, with its last lines)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if not is_alive():
            raise ClusterError(f"{what} exited during start-up; its log: {log_path}; last lines:\n{tail(log_path)}"
                               if log_path else f"{what}: the process exited")
        if time.monotonic() > deadline:
            where = f"; see {log_path}, last lines:\n{tail(log_path)}" if log_path else ""
            raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}{where}")
        time.sleep(0.5)


def is_shutting_down(server: str, context: ssl.SSLContext) -> bool:
    """kube-apiserver's `shutdown` readiness check fails from its SIGTERM until it exits."""
    try:
        with urllib.request.urlopen(f"{server}/readyz/shutdown", context=context, timeout=5):
            return False
    except urllib.error.HTTPError as error:
        return error.code >= 500
    except (urllib.error.URLError, OSError, ValueError):
        return False  # not listening: not started yet, or gone; start_daemon tells them apart


def node_is_ready(server: str, node: str, context: ssl.SSLContext) -> bool:
    try:
        status = get_json(f"{server}/api/v1/nodes/{node}", context).get("status", {})
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in status.get("conditions", []))


def namespace_is_usable(server: str, namespace: str, context: ssl.SSLContext) -> bool:
    """Pods can be created once the default ServiceAccount and the root CA ConfigMap exist
    (the ServiceAccount admission plugin rejects pods until then)."""
    base = f"{server}/api/v1/namespaces/{namespace}"
    return (get_ok(f"{base}/serviceaccounts/default", context)
            and get_ok(f"{base}/configmaps/kube-root-ca.crt", context))
