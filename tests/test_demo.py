"""The README's demo command keeps working: the served demo end to end, as a newcomer runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_served_demo_runs_every_adapter_through_the_http_server(tmp_path):
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-P", "-m", "kubelora.cli.main", "demo", "--engine-only", "--workdir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for name in ("tenant-a", "tenant-b", "tenant-c"):
        assert f"load {name}: 200" in out
        assert f"[ {name}]" in out
    assert "load ../../etc: 400" in out
    assert "completion for the unloaded tenant-a: 404" in out
    assert 'kubelora_requests_total{adapter="tenant-c",finish_reason="length"} 3.0' in out
