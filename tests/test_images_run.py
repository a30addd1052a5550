"""The built images (`make images`: build/images/*.tar) start and answer, run as the local kubelet runs them:
unpacked once (e2e/localkubelet/imagestore.py), then runc on that rootfs under an overlay, as a non-root user.

The operator and router run with a read-only root filesystem and no capabilities (the chart's securityContext);
the engine serves a tiny model on the CPU from its CUDA build of torch.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e"))

from localkubelet import runtime  # noqa: E402
from pytest_cluster import ensure_images  # noqa: E402
from localkubelet.imagestore import Image, ImageStore  # noqa: E402

from kubelora.operator.settings import VERSION  # noqa: E402  (the images' tag)
CHART_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"runAsNonRoot": True}


@pytest.fixture(scope="module")
def store() -> ImageStore:
    ensure_images()
    cache = Path(os.environ.get("KUBELORA_CACHE", Path.home() / ".cache" / "kubelora")) / "images"
    return ImageStore((ROOT / "build" / "images",), cache)


def image(store: ImageStore, name: str) -> Image:
    return store.get(f"localhost/{name}:{VERSION}")


@contextmanager
def container(img: Image, argv: list[str], tmp_path: Path, mounts: tuple = (),
              security: dict | None = None) -> Iterator[subprocess.Popen]:
    """`argv` in a container of the image, in this machine's network namespace; output in tmp_path/log."""
    security = CHART_SECURITY if security is None else security
    user = runtime.resolve_user({"securityContext": POD_SECURITY}, {"securityContext": security}, img)
    env = {"PATH": runtime.DEFAULT_PATH, **dict(img.config.env), "HOME": "/"}
    bundle = runtime.Bundle(f"kl-test-{uuid.uuid4().hex[:8]}", tmp_path / "bundle")
    config = runtime.build_config(img, tuple(argv), env, user, img.config.working_dir,
                                  "test", None, mounts, security)
    runtime.write_bundle(bundle, config)
    with open(tmp_path / "log", "wb") as log:
        process = subprocess.Popen(runtime.build_command(bundle, img, tmp_path / "pid"), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            for command in runtime.build_kill_commands(bundle.container_id):
                subprocess.run(command, capture_output=True)
            process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"exited with {process.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"{url} did not answer in {timeout_s:.0f}s: {log.read_text()[-3000:]}")


@pytest.mark.parametrize("name", ["kubelora-operator", "kubelora-engine"])
def test_each_image_runs_kubelora_as_non_root(store: ImageStore, name: str, tmp_path: Path) -> None:
    img = image(store, name)
    assert img.config.entrypoint == ("kubelora",)
    assert runtime.resolve_user({}, {}, img) == runtime.User(65532, 65532)  # the image's own USER
    with container(img, [*img.config.entrypoint, "--help"], tmp_path) as process:
        assert process.wait(timeout=120) == 0, (tmp_path / "log").read_text()
    assert "usage: kubelora" in (tmp_path / "log").read_text()


def test_a_read_only_root_is_read_only_and_the_shared_rootfs_never_changes(store: ImageStore,
                                                                            tmp_path: Path) -> None:
    img = image(store, "kubelora-operator")
    write = ["python3", "-c", "import pathlib; pathlib.Path('/tmp/written').write_text('x')"]
    for security, expected in ((CHART_SECURITY, 1), ({}, 0)):
        attempt = tmp_path / f"exit-{expected}"
        attempt.mkdir()
        with container(img, write, attempt, security=security) as process:
            assert process.wait(timeout=60) == expected, (attempt / "log").read_text()
    assert "Read-only file system" in (tmp_path / "exit-1" / "log").read_text()
    assert (tmp_path / "exit-0" / "bundle" / "upper" / "tmp" / "written").exists()  # the container's layer
    assert not (img.rootfs / "tmp" / "written").exists()


def test_the_control_plane_image_runs_the_router(store: ImageStore, tmp_path: Path) -> None:
    placement = tmp_path / "placement"
    placement.mkdir(mode=0o755)
    (placement / "placement.json").write_text(json.dumps(
        {"pool": "p", "baseModel": "m", "revision": 1, "adapters": {}, "replicas": []}))
    (placement / "placement.json").chmod(0o644)
    port = free_port()
    mounts = (runtime.ContainerMount(placement, "/etc/kubelora", True),)
    args = ["kubelora", "router", "--placement-file", "/etc/kubelora/placement.json", "--host", "127.0.0.1",
            "--port", str(port)]
    with container(image(store, "kubelora-operator"), args, tmp_path, mounts) as process:
        assert wait_healthy(f"http://127.0.0.1:{port}/health", process, tmp_path / "log", 60) == 200


def test_engine_image_serves_a_tiny_model_on_the_cpu(store: ImageStore, tmp_path: Path) -> None:
    from kubelora.cli.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model")  # world-readable: the engine runs as uid 65532
    port = free_port()
    mounts = (runtime.ContainerMount(model, "/models/tiny", True),)
    args = ["kubelora", "engine", "serve", "--model", "/models/tiny", "--device", "cpu", "--max-model-len", "128",
            "--max-lora-rank", "8", "--max-cpu-loras", "2",
            "--host", "127.0.0.1", "--port", str(port)]
    # The engine's pods have no securityContext: a writable root (the container's own layer), non-root.
    with container(image(store, "kubelora-engine"), args, tmp_path, mounts, security={}) as process:
        assert wait_healthy(f"http://127.0.0.1:{port}/health", process, tmp_path / "log", 120) == 200
        # /health answers as soon as the server listens; /ready once the model is loaded (the pod's probes).
        assert wait_healthy(f"http://127.0.0.1:{port}/ready", process, tmp_path / "log", 240) == 200
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                assert json.load(response)["usage"]["completion_tokens"] == 4
        except urllib.error.HTTPError as error:
            pytest.fail(f"{error}: {error.read()[:500]!r}; {(tmp_path / 'log').read_text()[-3000:]}")


def test_engine_image_carries_what_a_gpu_node_needs(store: ImageStore, tmp_path: Path) -> None:
    """The GPU half of "one image for GPU and CPU nodes", short of a GPU: torch is a CUDA build, its CUDA libraries
    (cuBLAS, cuDNN) load, Triton and the C compiler its launcher builds with are there. On a GPU node the NVIDIA
    container toolkit adds only the driver (docs/chart.md)."""
    probe = ("import ctypes, glob, json, os, shutil, torch, triton, nvidia; "
             "root = list(nvidia.__path__)[0]; "
             "lib = sorted(glob.glob(os.path.join(root, '**', 'libcublas.so*'), recursive=True))[0]; "
             "ctypes.CDLL(lib); "
             "print(json.dumps({'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(), "
             "'triton': triton.__version__, 'cc': shutil.which('cc') or shutil.which('gcc'), "
             "'gpu': torch.cuda.is_available()}))")
    with container(image(store, "kubelora-engine"), ["python3", "-c", probe], tmp_path, security={}) as process:
        assert process.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-3000:]
    found = json.loads((tmp_path / "log").read_text().strip().splitlines()[-1])
    assert found["cuda"] and found["cudnn"] and found["triton"] and found["cc"], found
    assert found["gpu"] is False  # this machine has none: the same image serves the CPU path above
