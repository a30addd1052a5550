"""Containers run from their images with runc: an OCI bundle per container attempt.

The rootfs is the image's shared unpacked directory (imagestore.py) under a per-attempt overlay: the upper
layer holds the container's writes and the mountpoints runc creates, so the shared directory never changes.
With `readOnlyRootFilesystem` runc remounts that root read-only, as a real runtime does; emptyDir volumes stay
the place to write. The overlay is mounted in a private mount namespace (`unshare`) that only the runc
process and the container see, so it goes away with them and nothing is left mounted on the host.

`runc run` stays in the foreground: it forwards SIGTERM to the container's init, and its exit status is the
container's. `--pid-file` records the container's own host pid (what `kill -9` of a container hits).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from .imagestore import Image

# What containerd and Docker set when the image has no PATH.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Docker's and containerd's default capability set.
DEFAULT_CAPABILITIES = tuple(f"CAP_{name}" for name in (
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP",
    "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE"))
MASKED_PATHS = ("/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
                "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware")
READONLY_PATHS = ("/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


class SecurityError(Exception):
    """The container's securityContext cannot be honoured (runAsNonRoot with a root user...)."""


@dataclass(frozen=True)
class User:
    uid: int
    gid: int


@dataclass(frozen=True)
class ContainerMount:
    source: Path
    target: str
    is_read_only: bool


@dataclass(frozen=True)
class Bundle:
    """One container attempt: its runc id and directory (config.json, overlay upper and work dirs)."""
    container_id: str
    path: Path

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs"


def resolve_user(pod_spec: dict, container: dict, image: Image) -> User:
    """runAsUser/runAsGroup (container over pod) over the image's USER; runAsNonRoot checked on the result."""
    context = {**(pod_spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    image_user, _, image_group = image.config.user.partition(":")
    uid = context.get("runAsUser")
    if uid is None:
        uid = lookup_id(image.rootfs / "etc" / "passwd", image_user or "0", image.reference)
    gid = context.get("runAsGroup")
    if gid is None:
        gid = lookup_id(image.rootfs / "etc" / "group", image_group, image.reference) if image_group else \
            primary_gid(image.rootfs / "etc" / "passwd", int(uid))
    if context.get("runAsNonRoot") and int(uid) == 0:
        raise SecurityError(f"container has runAsNonRoot and image {image.reference} will run as root")
    return User(int(uid), int(gid))


def lookup_id(table: Path, name: str, reference: str) -> int:
    if name.isdigit():
        return int(name)
    for line in table.read_text().splitlines() if table.exists() else ():
        fields = line.split(":")
        if fields[0] == name and len(fields) > 2:
            return int(fields[2])
    raise SecurityError(f"image {reference}: user or group {name!r} is not in {table.name}")


def primary_gid(passwd: Path, uid: int) -> int:
    for line in passwd.read_text().splitlines() if passwd.exists() else ():
        fields = line.split(":")
        if len(fields) > 3 and fields[2] == str(uid):
            return int(fields[3])
    return 0


def build_config(image: Image, argv: tuple[str, ...], env: dict[str, str], user: User, working_dir: str,
                 hostname: str, netns: str | None, mounts: tuple[ContainerMount, ...],
                 security: dict) -> dict:
    """The OCI runtime spec (config.json) runc runs. `security`: the container's securityContext."""
    capabilities = build_capabilities(security.get("capabilities") or {})
    namespaces = [{"type": kind} for kind in ("pid", "ipc", "uts", "mount")]
    if netns:  # hostNetwork pods stay in the host's network namespace
        namespaces.append({"type": "network", "path": f"/var/run/netns/{netns}"})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": user.uid, "gid": user.gid}, "args": list(argv),
            "env": [f"{key}={value}" for key, value in env.items()], "cwd": working_dir or "/",
            "capabilities": {kind: capabilities for kind in ("bounding", "effective", "permitted")},
            "noNewPrivileges": security.get("allowPrivilegeEscalation") is False,
        },
        "root": {"path": "rootfs", "readonly": bool(security.get("readOnlyRootFilesystem"))},
        "hostname": hostname,
        "mounts": [*system_mounts(), *(bind_mount(m) for m in mounts)],
        "linux": {"namespaces": namespaces, "maskedPaths": list(MASKED_PATHS),
                  "readonlyPaths": list(READONLY_PATHS)},
    }


def build_capabilities(change: dict) -> list[str]:
    """The default set, less `drop` (`ALL` drops every one), plus `add`."""
    drop = {f"CAP_{name.upper().removeprefix('CAP_')}" for name in change.get("drop") or ()}
    kept = [] if "CAP_ALL" in drop else [c for c in DEFAULT_CAPABILITIES if c not in drop]
    added = [f"CAP_{name.upper().removeprefix('CAP_')}" for name in change.get("add") or ()]
    return [*kept, *(c for c in added if c not in kept)]


def system_mounts() -> list[dict]:
    return [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]


def bind_mount(mount: ContainerMount) -> dict:
    options = ["rbind", "rprivate", *(["ro"] if mount.is_read_only else [])]
    return {"destination": mount.target, "type": "bind", "source": str(mount.source), "options": options}


def write_bundle(bundle: Bundle, config: dict) -> None:
    for name in ("rootfs", "upper", "work"):
        (bundle.path / name).mkdir(parents=True, exist_ok=True)
    (bundle.path / "config.json").write_text(json.dumps(config, indent=1))


def build_command(bundle: Bundle, image: Image, pid_file: Path) -> list[str]:
    """`unshare` + the overlay mount + `exec runc run`, so that the mount lives as long as the container."""
    overlay = (f"lowerdir={image.rootfs},upperdir={bundle.path / 'upper'},workdir={bundle.path / 'work'}")
    script = "\n".join([
        "set -e",
        f"mount -t overlay overlay -o {shlex.quote(overlay)} {shlex.quote(str(bundle.rootfs))}",
        'exec "$@"',
    ])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            "runc", "run", "--bundle", str(bundle.path), "--pid-file", str(pid_file), bundle.container_id]


def build_exec_command(container_id: str, argv: list[str]) -> list[str]:
    """An exec probe runs in the container (its namespaces, rootfs and user)."""
    return ["runc", "exec", container_id, *argv]


def build_kill_commands(container_id: str) -> list[list[str]]:
    """After the grace period: SIGKILL the container's processes, then forget its state."""
    return [["runc", "kill", "--all", container_id, "KILL"], ["runc", "delete", "--force", container_id]]
