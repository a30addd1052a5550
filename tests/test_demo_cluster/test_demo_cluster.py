"""`make demo`: the whole system (local control plane, chart, operator, pool, adapters, router, openai SDK)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(900)
def test_whole_system_demo_serves_every_adapter_through_the_router(cluster, tmp_path):
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-P", "-m", "kubelora.cli.main", "demo", "--workdir", str(tmp_path / "demo")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "loraadapter.kubelora.io/tenant-c   demo   Ready" in out
    for name in ("tenant-a", "tenant-b", "tenant-c", "tiny-llama"):
        assert f"[{name:>10}] 'Hello! How are you' -> " in out
    assert "a request for tenant-b now: Error code: 404" in out
    # The cluster was the fixture's: the demo cleaned up after itself and left it running.
    namespaces = json.loads(cluster.kubectl("get", "namespaces", "-o", "json").stdout)["items"]
    assert {"kubelora-demo", "kubelora-system"}.isdisjoint(ns["metadata"]["name"] for ns in namespaces)
