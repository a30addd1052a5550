"""s3:// adapter sources on a real API server, from a real S3 server: MinIO (e2e/s3) on the host.

Pods have their own IPs on the cluster's bridge, so MinIO listens on every host address and pods reach it at the
bridge address, as they reach the HTTP adapter server. A LoRAAdapter naming an archive object and a Secret with
the key pair becomes Ready and answers as the same adapter from a path does; one applied before its object
exists retries (LoadRetrying) and becomes Ready once the object is uploaded; wrong keys are Failed for good;
malformed s3 sources are refused at admission.
"""
from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from pytest_cluster import wait_for

from .test_operator_lifecycle import (adapter, complete, offline, ready_engine_pods, served_adapters,  # noqa: F401
                                      wait_phase)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "s3"))
from s3server import MinioServer, build_minio  # noqa: E402

BUCKET = "tenant-adapters"
POOL = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAPool
metadata: {{name: pool1}}
spec:
  model: {{path: /models/tiny, servedName: tiny}}
  modelVolume: {{hostPath: {models}, mountPath: /models}}
  adapterS3Buckets: [{bucket}]
  adapterS3Endpoints: ["{endpoint}"]
  replicas: 1
  engine: {{device: cpu, maxLoras: 2, maxLoraRank: 8, maxCpuLoras: 4, maxModelLen: 256, maxNumSeqs: 8}}
"""
S3_ADAPTER = """
apiVersion: kubelora.io/v1alpha1
kind: LoRAAdapter
metadata: {{name: {name}}}
spec: {{pool: pool1, source: {{url: "{url}", authSecretRef: {{name: {secret}}}, s3: {{endpoint: "{endpoint}"}}}}}}
"""


def archive_of(directory: Path) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(directory / name, arcname=name)
    return data.getvalue()


@pytest.fixture(scope="module")
def minio(cluster, tmp_path_factory, shown):
    """MinIO on every host address; `endpoint` names the bridge address pods reach the host at."""
    with shown():  # minutes on a fresh machine: say so
        build_minio()
    bridge = next(urlsplit(line.split()[-1]).hostname for line in cluster.kubeconfig.read_text().splitlines()
                  if line.strip().startswith("server:"))
    with MinioServer(tmp_path_factory.mktemp("minio-e2e") / "data", listen_host="0.0.0.0",
                     advertised_host=bridge) as server:
        server.make_bucket(BUCKET)
        yield server


def test_s3_adapters_become_ready_retry_until_uploaded_and_fail_on_wrong_keys(operator_env, material, offline,
                                                                               minio) -> None:
    env = operator_env
    for name, secret in (("s3-creds", minio.secret_access_key), ("s3-wrong", "not-the-secret-key")):
        env.cluster.kubectl("create", "secret", "generic", name, "-n", env.namespace,
                            f"--from-literal=AWS_ACCESS_KEY_ID={minio.access_key_id}",
                            f"--from-literal=AWS_SECRET_ACCESS_KEY={secret}")
    minio.put(BUCKET, "a1.tar.gz", archive_of(material.adapters_dir / "a1"))
    env.cluster.apply(POOL.format(models=material.model_dir.parent, bucket=BUCKET, endpoint=minio.endpoint),
                      namespace=env.namespace)
    for name, key, secret in (("from-s3", "a1.tar.gz", "s3-creds"), ("late", "a2/", "s3-creds"),
                              ("wrong-keys", "a1.tar.gz", "s3-wrong")):
        env.cluster.apply(S3_ADAPTER.format(name=name, url=f"s3://{BUCKET}/{key}", secret=secret,
                                            endpoint=minio.endpoint), namespace=env.namespace)

    # The API server's admission (the CRD schema and its CEL rules) refuses malformed s3 sources outright.
    for source, expected in (('{url: "s3://Bad_Bucket/a.tar.gz"}', "spec.source.url"),
                             ('{path: /adapters/a, s3: {region: eu-west-1}}', "source.s3 is for s3:// urls only"),
                             ('{url: "s3://b-1/a", s3: {endpoint: "ftp://m:9000"}}', "spec.source.s3.endpoint")):
        manifest = f"apiVersion: kubelora.io/v1alpha1\nkind: LoRAAdapter\nmetadata: {{name: bad}}\n" \
                   f"spec: {{pool: pool1, source: {source}}}\n"
        result = env.cluster.kubectl("apply", "-n", env.namespace, "-f", "-", stdin=manifest, check=False)
        assert result.returncode != 0 and expected in result.stderr, (source, result.stderr)

    ready = wait_phase(env, "from-s3", "Ready", timeout_s=150)
    assert ready["status"]["readyReplicas"] == 1
    wrong = wait_phase(env, "wrong-keys", "Failed")
    reason, message = next((c["reason"], c["message"]) for c in wrong["status"]["conditions"] if c["type"] == "Ready")
    assert reason == "DownloadFailed" and "403" in message and "not-the-secret-key" not in message
    # The GitOps ordering: the manifest before its artifact. The prefix's files are not there yet: retried.
    def retrying() -> dict | None:
        body = adapter(env, "late")
        ready = {c["type"]: c for c in body.get("status", {}).get("conditions") or []}.get("Ready") or {}
        return body if ready.get("reason") == "LoadRetrying" else None

    waiting = wait_for("late retrying", retrying, timeout_s=120)
    assert waiting["status"]["phase"] == "Loading" and "NoSuchKey" in str(waiting["status"]["replicas"])
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        minio.put(BUCKET, f"a2/{name}", (material.adapters_dir / "a2" / name).read_bytes())
    wait_phase(env, "late", "Ready", timeout_s=120)

    (pod, ip), = ready_engine_pods(env).items()
    assert complete(ip, "from-s3") == offline["a1"] != offline["tiny"]
    assert complete(ip, "late") == offline["a2"]
    cards = served_adapters(ip)
    assert cards["from-s3"]["source"] == f"s3://{BUCKET}/a1.tar.gz"
    assert minio.secret_access_key not in str(cards) and "wrong-keys" not in cards
