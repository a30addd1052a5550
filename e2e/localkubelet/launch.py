"""Start one container attempt: the runc command runtime.py builds, its output into the attempt's log file."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from .runtime import ContainerMount


@dataclass(frozen=True)
class LaunchSpec:
    """What the kubelet starts: `command` with `env`, output to `log_path`; `container_id` names the runc
    container, which the kubelet kills through runc after the grace period."""
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    log_path: Path
    container_id: str


def build_mounts(container: dict, volume_paths: dict[str, Path]) -> tuple[ContainerMount, ...]:
    mounts = []
    for mount in container.get("volumeMounts", []):
        source = volume_paths[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        mounts.append(ContainerMount(source, mount["mountPath"], bool(mount.get("readOnly"))))
    return tuple(mounts)


def start_process(spec: LaunchSpec) -> subprocess.Popen:
    """The process leads its own session so a pod's whole process tree can be signalled."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "ab") as log:
        return subprocess.Popen(spec.command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(spec.env),
                                start_new_session=True)
