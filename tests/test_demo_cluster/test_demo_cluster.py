"""`make demo`: the whole system (local control plane, chart, operator, pool, adapters, router, openai SDK)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kubelora.cli import story


@pytest.mark.timeout(900)
def test_whole_system_demo_serves_every_adapter_through_the_router(cluster, tmp_path):
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-P", "-m", "kubelora.cli.main", "demo", "--workdir", str(tmp_path / "demo")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for name in ("pirate", "legal", "haiku"):
        assert re.search(rf"^loraadapter.kubelora.io/{name} +demo +Ready", out, re.M), out[-3000:]
    # every prompt to the base model and each tenant through the router, in the tenant's style, each answer
    # equal to transformers+PEFT's
    for model, words in [("base", ()), *story.STYLE_WORDS.items()]:
        for prompt in story.PROMPTS:
            line = re.search(rf"^   \[ *{model}\] {re.escape(prompt)} ->(.*)\n(.*)$", out, re.M)
            assert line, (model, prompt, out[-3000:])
            assert all(word in line.group(1) for word in words), line.group(1)
            assert line.group(2).strip() == "= transformers+PEFT's answer", line.group(0)
    assert "== 12 of 12 answers equal transformers+PEFT's" in out
    assert "a request for legal now: Error code: 404" in out
    # The cluster was the fixture's: the demo cleaned up after itself and left it running.
    namespaces = json.loads(cluster.kubectl("get", "namespaces", "-o", "json").stdout)["items"]
    assert {"kubelora-demo", "kubelora-system"}.isdisjoint(ns["metadata"]["name"] for ns in namespaces)
