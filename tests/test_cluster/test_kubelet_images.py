"""The local kubelet's image side without a cluster: archives unpacked with whiteouts, references matched
whatever the registry, argv/user/securityContext rules, and the runc config they become."""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from localkubelet import runtime
from localkubelet.images import UnknownEntrypoint, build_argv
from localkubelet.imagestore import Image, ImageConfig, ImageError, ImageStore, image_key


def _layer(files: dict[str, bytes | None]) -> bytes:
    """A layer tar: path -> content (None: a directory)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer:
        for path, content in files.items():
            info = tarfile.TarInfo(path)
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                layer.addfile(info)
            else:
                info.size, info.mode = len(content), 0o644
                layer.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def write_archive(path: Path, tag: str, layers: list[dict], config: dict) -> None:
    """A docker-archive as `podman save` writes it: manifest.json, the config, one tar per layer."""
    members = {f"layer{i}.tar": _layer(files) for i, files in enumerate(layers)}
    members["abc123.json"] = json.dumps({"config": config}).encode()
    members["manifest.json"] = json.dumps([{"Config": "abc123.json", "RepoTags": [tag],
                                            "Layers": [f"layer{i}.tar" for i in range(len(layers))]}]).encode()
    with tarfile.open(path, "w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    archives = tmp_path / "archives"
    archives.mkdir()
    write_archive(archives / "app.tar", "localhost/app:1.0", [
        {"etc/": None, "etc/passwd": b"root:x:0:0::/root:/bin/sh\napp:x:1000:1001::/:/bin/sh\n",
         "etc/group": b"root:x:0:\napp:x:1001:\n", "gone.txt": b"x", "cache/": None, "cache/old": b"x"},
        {".wh.gone.txt": b"", "cache/": None, "cache/.wh..wh..opq": b"", "cache/new": b"y", "kept": b"z"},
    ], {"Entrypoint": ["/bin/app"], "Cmd": ["serve"], "Env": ["PATH=/opt/bin:/bin", "MODE=prod"],
        "User": "app", "WorkingDir": "/srv"})
    (archives / "half-written.tar").write_bytes(b"not a tar")  # one `make images` is still writing
    return ImageStore((archives,), tmp_path / "cache")


def test_an_archive_unpacks_once_with_its_whiteouts(store: ImageStore, tmp_path: Path) -> None:
    image = store.get("registry.example.com/team/app:1.0")  # any registry: matched on name and tag
    root = image.rootfs
    assert not (root / "gone.txt").exists()
    assert sorted(p.name for p in (root / "cache").iterdir()) == ["new"]  # the opaque dir hid "old"
    assert (root / "kept").read_bytes() == b"z" and not list(root.rglob(".wh.*"))
    assert image.config == ImageConfig(("/bin/app",), ("serve",), (("PATH", "/opt/bin:/bin"), ("MODE", "prod")),
                                       "app", "/srv")
    marker = root / "marker"
    marker.write_text("unpacked once")
    assert store.get("app:1.0").rootfs == root and marker.exists()  # the second container shares it


def test_unknown_images_are_an_image_error(store: ImageStore) -> None:
    with pytest.raises(ImageError, match="make images"):
        store.get("app:2.0")
    assert image_key("ghcr.io/a/b/kubelora-engine@sha256:00") == "kubelora-engine:latest"


def test_prune_keeps_only_what_an_archive_holds(store: ImageStore, tmp_path: Path) -> None:
    kept = store.get("app:1.0").rootfs.parent
    stale = tmp_path / "cache" / "oldimage"
    stale.mkdir()
    store.prune()
    assert kept.exists() and not stale.exists()


def test_argv_follows_kubernetes_rules() -> None:
    config = ImageConfig(("/bin/app",), ("serve",), (), "", "/")
    assert build_argv({}, config) == ["/bin/app", "serve"]
    assert build_argv({"args": ["check"]}, config) == ["/bin/app", "check"]
    assert build_argv({"command": ["sh"], "args": ["-c", "x"]}, config) == ["sh", "-c", "x"]
    assert build_argv({"command": ["sh"]}, config) == ["sh"]  # command drops CMD too
    with pytest.raises(UnknownEntrypoint):
        build_argv({}, ImageConfig((), (), (), "", "/"))


def test_user_from_the_image_or_the_security_context(store: ImageStore) -> None:
    image = store.get("app:1.0")
    assert runtime.resolve_user({}, {}, image) == runtime.User(1000, 1001)  # named user, its primary group
    pod = {"securityContext": {"runAsUser": 2000, "runAsNonRoot": True}}
    assert runtime.resolve_user(pod, {}, image) == runtime.User(2000, 0)
    assert runtime.resolve_user(pod, {"securityContext": {"runAsUser": 3000, "runAsGroup": 7}}, image) == \
        runtime.User(3000, 7)
    with pytest.raises(runtime.SecurityError, match="runAsNonRoot"):
        runtime.resolve_user(pod, {"securityContext": {"runAsUser": 0}}, image)
    root_image = Image("r", "d", image.rootfs, ImageConfig((), (), (), "", "/"))
    with pytest.raises(runtime.SecurityError):
        runtime.resolve_user({"securityContext": {"runAsNonRoot": True}}, {}, root_image)


def test_capabilities() -> None:
    assert runtime.build_capabilities({"drop": ["ALL"]}) == []
    assert runtime.build_capabilities({"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}) == ["CAP_NET_BIND_SERVICE"]
    kept = runtime.build_capabilities({"drop": ["KILL"], "add": ["CAP_NET_ADMIN"]})
    assert "CAP_KILL" not in kept and kept[-1] == "CAP_NET_ADMIN" and "CAP_CHOWN" in kept


def test_runc_config(store: ImageStore) -> None:
    image = store.get("app:1.0")
    mounts = (runtime.ContainerMount(Path("/host/models"), "/models", True),)
    security = {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    config = runtime.build_config(image, ("/bin/app",), {"A": "1"}, runtime.User(1000, 1001), "/srv", "pod-0",
                                  "klr-abc", mounts, security)
    process = config["process"]
    assert process["user"] == {"uid": 1000, "gid": 1001} and process["env"] == ["A=1"]
    assert process["noNewPrivileges"] and process["capabilities"]["effective"] == []
    assert config["root"] == {"path": "rootfs", "readonly": True} and config["hostname"] == "pod-0"
    assert {"type": "network", "path": "/var/run/netns/klr-abc"} in config["linux"]["namespaces"]
    bind = next(m for m in config["mounts"] if m["destination"] == "/models")
    assert bind["source"] == "/host/models" and "ro" in bind["options"]
    host_network = runtime.build_config(image, ("x",), {}, runtime.User(0, 0), "/", "p", None, (), {})
    assert not any(n["type"] == "network" for n in host_network["linux"]["namespaces"])
    assert host_network["root"]["readonly"] is False and not host_network["process"]["noNewPrivileges"]


def test_the_command_mounts_the_overlay_then_execs_runc(store: ImageStore, tmp_path: Path) -> None:
    image = store.get("app:1.0")
    bundle = runtime.Bundle("klr-abc-main-0", tmp_path / "bundle")
    runtime.write_bundle(bundle, {"ociVersion": "1.0.2"})
    command = runtime.build_command(bundle, image, tmp_path / "main.pid")
    assert command[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert f"lowerdir={image.rootfs},upperdir={bundle.path / 'upper'}" in command[6]
    assert command[-7:] == ["runc", "run", "--bundle", str(bundle.path), "--pid-file", str(tmp_path / "main.pid"),
                            "klr-abc-main-0"]
    assert os.path.isdir(bundle.path / "upper") and os.path.isdir(bundle.path / "rootfs")
