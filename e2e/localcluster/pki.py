"""Certificates and service-account keys, made with the openssl CLI (Debian's `openssl`).

One CA signs every certificate. Identities follow kubeadm so RBAC's bootstrap roles apply:
the kubelet is `system:node:<name>` in `system:nodes` (Node authorizer + NodeRestriction),
the controller-manager and scheduler use their `system:kube-*` users, admin is in
`system:masters`. etcd listens on loopback without TLS (test-only shortcut, documented).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

CERT_DAYS = "3650"


@dataclass(frozen=True)
class CertSpec:
    name: str
    subject: str
    sans: tuple[str, ...] = ()


def build_cert_specs(node_name: str, node_ip: str, service_ip: str) -> tuple[CertSpec, ...]:
    apiserver_sans = (
        f"IP:{node_ip}", "IP:127.0.0.1", f"IP:{service_ip}", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    )
    return (
        CertSpec("apiserver", "/CN=kube-apiserver", apiserver_sans),
        CertSpec("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client"),
        CertSpec("admin", "/O=system:masters/CN=kubelora-admin"),
        CertSpec("controller-manager", "/CN=system:kube-controller-manager"),
        CertSpec("scheduler", "/CN=system:kube-scheduler"),
        CertSpec("kubelet", f"/O=system:nodes/CN=system:node:{node_name}"),
        CertSpec("kubelet-serving", f"/CN={node_name}", (f"IP:{node_ip}", f"DNS:{node_name}")),
    )


def ensure_pki(pki_dir: Path, specs: tuple[CertSpec, ...]) -> None:
    """Create whatever is missing; existing files are kept so `up` twice is harmless."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    ensure_ca(pki_dir)
    ensure_service_account_keys(pki_dir)
    for spec in specs:
        if not (pki_dir / f"{spec.name}.crt").exists():
            issue_cert(pki_dir, spec)


def ensure_ca(pki_dir: Path) -> None:
    if (pki_dir / "ca.crt").exists():
        return
    make_key(pki_dir / "ca.key")
    openssl("req", "-x509", "-new", "-key", pki_dir / "ca.key", "-subj", "/CN=kubelora-e2e-ca",
            "-days", CERT_DAYS, "-out", pki_dir / "ca.crt")


def ensure_service_account_keys(pki_dir: Path) -> None:
    # RSA: the API server signs service-account tokens with RS256 by default.
    if (pki_dir / "sa.key").exists():
        return
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", pki_dir / "sa.key")
    openssl("pkey", "-in", pki_dir / "sa.key", "-pubout", "-out", pki_dir / "sa.pub")


def issue_cert(pki_dir: Path, spec: CertSpec) -> None:
    key, csr, crt = (pki_dir / f"{spec.name}.{ext}" for ext in ("key", "csr", "crt"))
    make_key(key)
    request = ["req", "-new", "-key", key, "-subj", spec.subject, "-out", csr]
    if spec.sans:
        request += ["-addext", "subjectAltName=" + ",".join(spec.sans)]
    openssl(*request)
    openssl("x509", "-req", "-in", csr, "-CA", pki_dir / "ca.crt", "-CAkey", pki_dir / "ca.key",
            "-CAcreateserial", "-days", CERT_DAYS, "-copy_extensions", "copyall", "-out", crt)
    csr.unlink()


def make_key(path: Path) -> None:
    # P-256 keys: generated instantly, unlike RSA, and every component accepts them.
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path)
    path.chmod(0o600)


def openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
