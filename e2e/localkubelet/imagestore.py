"""Container images from `podman save` / `docker save` archives, each unpacked once into a shared rootfs.

`make images` leaves `build/images/<name>.tar` (docker-archive: manifest.json, the image config, one tar per
layer). An image reference is resolved by repository name and tag (`ghcr.io/acme/kubelora-engine:0.1.0` and
`localhost/kubelora-engine:0.1.0` are the same image), so the chart's registry value does not matter here.
The first container of an image unpacks its layers (whiteouts applied) into `<cache>/<config digest>/rootfs`;
every later container, of any pod, runs on that directory read-only (runtime.py adds a writable layer).
"""
from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class ImageError(Exception):
    """The image is not in any archive, or its archive cannot be unpacked."""


@dataclass(frozen=True)
class ImageConfig:
    """What the image's config contributes to a container (the OCI image config's `config`)."""
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    user: str
    working_dir: str

    @classmethod
    def parse(cls, config: dict) -> ImageConfig:
        inner = config.get("config") or {}
        env = tuple(tuple(item.split("=", 1)) for item in inner.get("Env") or () if "=" in item)
        return cls(tuple(inner.get("Entrypoint") or ()), tuple(inner.get("Cmd") or ()), env,
                   inner.get("User") or "", inner.get("WorkingDir") or "/")


@dataclass(frozen=True)
class Image:
    reference: str
    digest: str
    rootfs: Path
    config: ImageConfig


@dataclass(frozen=True)
class _Archive:
    path: Path
    config_name: str
    layers: tuple[str, ...]


def image_key(reference: str) -> str:
    """`ghcr.io/acme/kubelora-engine:0.1@sha256:...` -> `kubelora-engine:0.1`; no tag means `latest`."""
    name = reference.split("@", 1)[0].rsplit("/", 1)[-1]
    return name if ":" in name else f"{name}:latest"


@functools.lru_cache(maxsize=64)
def read_manifest(path: Path, mtime_ns: int, size: int) -> tuple[tuple[str, _Archive], ...]:
    """(image key, archive) of one archive; keyed by its stat, so a rebuilt archive is read again. An archive
    that is not (yet) a complete image archive, one `make images` is still writing, has none."""
    try:
        with tarfile.open(path) as archive:
            manifest = json.load(archive.extractfile("manifest.json"))
        return tuple((image_key(tag), _Archive(path, entry["Config"], tuple(entry["Layers"])))
                     for entry in manifest for tag in entry.get("RepoTags") or ())
    except (OSError, KeyError, ValueError, tarfile.TarError):
        return ()


def read_index(archive_dirs: tuple[Path, ...]) -> dict[str, _Archive]:
    """image key -> archive, over every `*.tar` in the directories (earlier directories win)."""
    index: dict[str, _Archive] = {}
    for directory in archive_dirs:
        for path in sorted(directory.glob("*.tar")) if directory.is_dir() else ():
            stat = path.stat()
            for key, archive in read_manifest(path, stat.st_mtime_ns, stat.st_size):
                index.setdefault(key, archive)
    return index


def unpack_layer(outer: tarfile.TarFile, name: str, rootfs: Path) -> None:
    """Apply one layer: its whiteouts delete what lower layers put there, then GNU tar extracts its files with
    owners, modes, hard links and device nodes as stored. The layer is read twice from the archive: its
    headers (tarfile seeks over the data), then the whole stream into tar's stdin: no copy on disk."""
    with tarfile.open(fileobj=outer.extractfile(name)) as layer:
        apply_whiteouts(layer, rootfs)
    tar = subprocess.Popen(["tar", "-x", "-p", "--numeric-owner", "--same-owner", f"--exclude={WHITEOUT}*",
                            "-C", str(rootfs), "-f", "-"], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    with outer.extractfile(name) as source:
        shutil.copyfileobj(source, tar.stdin, 1 << 20)
    tar.stdin.close()
    if tar.wait() != 0:
        raise subprocess.CalledProcessError(tar.returncode, tar.args, stderr=tar.stderr.read())


def apply_whiteouts(layer: tarfile.TarFile, rootfs: Path) -> None:
    for member in layer.getmembers():
        path = PurePosixPath(member.name.removeprefix("./").lstrip("/") or ".")  # `.wh.` names start with a dot
        if ".." in path.parts:
            raise ImageError(f"layer member {member.name!r} leaves the rootfs")
        if path.name == OPAQUE:
            target = rootfs / path.parent
            for child in target.iterdir() if target.is_dir() else ():
                remove(child)
        elif path.name.startswith(WHITEOUT):
            remove(rootfs / path.parent / path.name[len(WHITEOUT):])


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class ImageStore:
    """Resolves references to unpacked images; thread-safe (one pod worker thread per pod)."""

    def __init__(self, archive_dirs: tuple[Path, ...], cache_dir: Path) -> None:
        self._archive_dirs = archive_dirs
        self._cache_dir = cache_dir
        self._lock = threading.Lock()

    def prune(self) -> None:
        """Remove unpacked images no archive holds any more (rebuilt images); only while no container runs."""
        current = {PurePosixPath(a.config_name).stem for a in read_index(self._archive_dirs).values()}
        for path in self._cache_dir.iterdir() if self._cache_dir.is_dir() else ():
            if path.name not in current:
                remove(path)

    def get(self, reference: str) -> Image:
        with self._lock:  # one unpack at a time: two pods of a new image must not unpack it twice
            archive = read_index(self._archive_dirs).get(image_key(reference))
            if archive is None:
                dirs = ", ".join(str(d) for d in self._archive_dirs)
                raise ImageError(f"image {reference!r} is in no archive under {dirs} (make images)")
            with tarfile.open(archive.path) as outer:
                config = json.load(outer.extractfile(archive.config_name))
                digest = PurePosixPath(archive.config_name).stem
                rootfs = self._cache_dir / digest / "rootfs"
                if not rootfs.is_dir():
                    self._unpack(outer, archive, rootfs)
        return Image(reference, digest, rootfs, ImageConfig.parse(config))

    def _unpack(self, outer: tarfile.TarFile, archive: _Archive, rootfs: Path) -> None:
        partial = rootfs.with_name("rootfs.partial")
        remove(partial)
        partial.mkdir(parents=True)
        partial.chmod(0o755)
        try:
            for name in archive.layers:
                unpack_layer(outer, name, partial)
        except (OSError, tarfile.TarError, subprocess.CalledProcessError) as error:
            raise ImageError(f"unpacking {archive.path}: {error}") from error
        partial.rename(rootfs)
