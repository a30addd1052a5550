"""Where the operator's API client gets its server and credentials (operator/kube.py, kopf's login helpers)."""

from __future__ import annotations

import kopf
import pytest

from kubelora.operator import kube

KUBECONFIG = """
apiVersion: v1
kind: Config
current-context: dev
contexts: [{name: dev, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: tok}}]
"""


def test_in_a_pod_the_service_account_at_the_api_services_address(monkeypatch):
    monkeypatch.setattr(kopf, "login_with_service_account", lambda **_: kopf.ConnectionInfo(
        server="https://kubernetes.default.svc", token="sa-token", insecure=True))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    connection = kube.load_connection()
    assert connection.server == "https://10.96.0.1:443"  # no cluster DNS needed
    assert connection.headers == {"Authorization": "Bearer sa-token"}
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert kube.load_connection().server == "https://[fd00::1]:443"


def test_outside_a_pod_the_kubeconfig(monkeypatch, tmp_path):
    monkeypatch.setattr(kopf, "login_with_service_account", lambda **_: None)
    (tmp_path / "config").write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    connection = kube.load_connection()
    assert connection.server == "https://127.0.0.1:6443"
    assert connection.headers == {"Authorization": "Bearer tok"}
    assert not connection.ssl_context.check_hostname  # insecure-skip-tls-verify
    monkeypatch.setenv("KUBECONFIG", "")
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))
    with pytest.raises(kopf.LoginError, match="no Kubernetes credentials"):
        kube.load_connection()
