"""`kubelora engine serve` as a process: settings from flags and KUBELORA_* variables, JSON log lines,
/ready, a request, SIGTERM -> exit 0; bad settings -> 2; an engine that cannot start -> 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from ..live_http import free_port


def _serve(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-P", "-m", "kubelora.cli.main", "engine", "serve", *args]
    return subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all("event" in e and "ts" in e and "level" in e for e in events)
    return events


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server not ready")


def test_serve_from_env_and_flags(material, tmp_path):
    port, admin_port = free_port(), free_port()
    token = tmp_path / "token"
    token.write_text("t0k3n\n")
    env = {"KUBELORA_MODEL": str(material.model_dir), "KUBELORA_MAX_LORAS": "2", "KUBELORA_MAX_LORA_RANK": "16",
           "KUBELORA_MAX_CPU_LORAS": "4", "KUBELORA_MAX_MODEL_LEN": "256", "KUBELORA_PORT": "1",
           "KUBELORA_SERVED_MODEL_NAME": "tiny", "KUBELORA_ADAPTER_ROOT": str(material.adapter_root),
           "KUBELORA_ADMIN_TOKEN_FILE": str(token), "KUBELORA_ADMIN_PORT": str(admin_port)}
    process = _serve(["--port", str(port), "--host", "127.0.0.1", "--lora", f"a0={material.adapters['a0']}"], env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process)
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "a0"]
        assert client.completions.create(model="a0", prompt="Hello", max_tokens=3).usage.completion_tokens == 3
        admin_url = f"http://127.0.0.1:{admin_port}"
        for base, token, status in ((url, "t0k3n", 404), (admin_url, None, 401), (admin_url, "wrong", 401)):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            request = urllib.request.Request(base + "/v1/unload_lora_adapter", data=b'{"lora_name": "a0"}',
                                             headers=headers, method="POST")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request)
            assert refused.value.code == status
        request = urllib.request.Request(admin_url + "/v1/unload_lora_adapter", data=b'{"lora_name": "a0"}',
                                         headers={"Authorization": "Bearer t0k3n"}, method="POST")
        with urllib.request.urlopen(request) as response:
            assert json.loads(response.read())["was_loaded"]
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    events = [e["event"] for e in _json_lines(stderr)]
    for event in ("starting", "admin_listening", "listening", "adapter_loaded", "engine_ready", "adapter_unloaded", "stopped"):
        assert event in events, events
    assert "t0k3n" not in stderr


@pytest.mark.parametrize("args, env, code, event", [
    (["--max-loras", "2"], {}, 2, "invalid_settings"),
    (["--model", "/nonexistent", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2",
      "--max-model-len", "64", "--port", "0", "--host", "127.0.0.1"], {}, 1, "engine_start_failed"),
])
def test_serve_fails_cleanly(args, env, code, event):
    process = _serve(args, {k: v for k, v in env.items()})
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == code, stderr
    assert event in [e["event"] for e in _json_lines(stderr)]
