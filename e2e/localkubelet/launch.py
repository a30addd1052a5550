"""Start one container attempt as a process in its pod's network namespace.

Two ways: from its image with runc (runtime.py; the kubelet was given image archives), or as a process of
this machine's Python environment (no image archives). For the latter, `ip netns exec` also gives the process a private mount namespace (it remounts /sys there),
so volume mounts are bind mounts made inside it by a small shell prelude, invisible to the
host: `/var/run/secrets/kubernetes.io/serviceaccount` works exactly as in a real pod. The
host filesystem is otherwise shared; mount targets that do not exist are created (and
recorded so `cluster down` removes them while empty).
"""
from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BindMount:
    source: Path
    target: Path
    is_read_only: bool


@dataclass(frozen=True)
class HostProcess:
    argv: tuple[str, ...]
    netns: str | None        # None: hostNetwork, the host's namespace
    mounts: tuple[BindMount, ...]
    working_dir: str


@dataclass(frozen=True)
class LaunchSpec:
    """What the kubelet starts: `command` with `env`, output to `log_path`. `container_id` names the runc
    container (None for a host process), which the kubelet kills through runc after the grace period."""
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    log_path: Path
    container_id: str | None = None


def build_mounts(container: dict, volume_paths: dict[str, Path]) -> tuple[BindMount, ...]:
    mounts = []
    for mount in container.get("volumeMounts", []):
        source = volume_paths[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        mounts.append(BindMount(source, Path(mount["mountPath"]), bool(mount.get("readOnly"))))
    return tuple(mounts)


def ensure_mountpoints(mounts: tuple[BindMount, ...], record: Path) -> None:
    """Bind mounts need an existing target of the source's kind on the shared filesystem."""
    created = []
    for mount in mounts:
        missing = [p for p in (mount.target, *mount.target.parents) if not p.exists()]
        if mount.source.is_dir():
            mount.target.mkdir(parents=True, exist_ok=True)
        elif not mount.target.exists():
            mount.target.parent.mkdir(parents=True, exist_ok=True)
            mount.target.touch()
        created += [str(p) for p in missing]
    if created:
        with open(record, "a") as out:
            out.write("".join(f"{path}\n" for path in created))


def build_prelude(mounts: tuple[BindMount, ...], working_dir: str) -> str:
    lines = ["set -e"]
    for mount in mounts:
        source, target = shlex.quote(str(mount.source)), shlex.quote(str(mount.target))
        lines.append(f"mount --bind {source} {target}")
        if mount.is_read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    lines += [f"cd {shlex.quote(working_dir)}", 'exec "$@"']
    return "\n".join(lines)


def build_host_command(spec: HostProcess) -> tuple[str, ...]:
    # hostNetwork pods still need a private mount namespace for their volume mounts.
    namespace = ["ip", "netns", "exec", spec.netns] if spec.netns else \
        ["unshare", "--mount", "--propagation", "private"]
    return (*namespace, "sh", "-c", build_prelude(spec.mounts, spec.working_dir), "sh", *spec.argv)


def start_process(spec: LaunchSpec) -> subprocess.Popen:
    """The process leads its own session so a pod's whole process tree can be signalled."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "ab") as log:
        return subprocess.Popen(spec.command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(spec.env),
                                start_new_session=True)
