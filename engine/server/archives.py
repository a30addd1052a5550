"""Safe extraction of downloaded adapter archives (.tar, .tar.gz/.tgz, .zip).

Only regular files and directories are extracted. A member with an absolute name, a `..` component, a link
or a device refuses the whole archive, and so does content larger than `max_bytes` (an archive bomb) or more
than `MAX_MEMBERS` entries (200k empty files would otherwise become 200k files in the cache).
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from kubelora.contract.errors import AdapterSourceError

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_MEMBERS = 1000  # a PEFT adapter is a handful of files


def _refuse(message: str) -> AdapterSourceError:
    return AdapterSourceError(message, param="lora_path", code="unsafe_archive")


def _safe_relative(name: str) -> PurePosixPath:
    path = PurePosixPath(name.replace("\\", "/"))
    has_drive = bool(path.parts) and ":" in path.parts[0]
    if path.is_absolute() or has_drive or ".." in path.parts:
        raise _refuse(f"archive member {name!r} has an absolute path or a '..' component")
    return path


def extract_archive(archive: Path, url_path: str, dest: Path, *, max_bytes: int) -> None:
    """Extract `archive` (kind from the URL path's suffix) into `dest`, which must not exist yet."""
    dest.mkdir(parents=True)
    lowered = url_path.lower()
    try:
        if lowered.endswith(".zip"):
            _extract_zip(archive, dest, max_bytes)
        else:
            _extract_tar(archive, dest, max_bytes)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise _refuse(f"cannot read the adapter archive: {exc}") from None


@dataclass(frozen=True)
class _Member:
    """One archive entry, whatever the format: checked first, extracted only once every entry passed."""
    name: str
    is_dir: bool
    is_regular: bool  # a plain file or a directory; links, devices and fifos are not
    size: int
    open: Callable[[], BinaryIO]


def _extract_tar(archive: Path, dest: Path, max_bytes: int) -> None:
    with tarfile.open(archive, mode="r:*") as tar:
        members = []
        for m in tar:  # one header at a time: getmembers() would read every header of a huge archive first
            members.append(_Member(m.name, m.isdir(), m.isfile() or m.isdir(), m.size, lambda m=m: tar.extractfile(m)))
            _check_count(len(members))
        _extract_members(members, dest, max_bytes)


def _extract_zip(archive: Path, dest: Path, max_bytes: int) -> None:
    with zipfile.ZipFile(archive) as zf:
        _check_count(len(zf.infolist()))
        members = []
        for info in zf.infolist():
            kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the writer stored no Unix mode
            members.append(_Member(info.filename, info.is_dir(), kind in (0, stat.S_IFREG, stat.S_IFDIR),
                                   info.file_size, lambda info=info: zf.open(info)))
        _extract_members(members, dest, max_bytes)


def _check_count(num_members: int) -> None:
    if num_members > MAX_MEMBERS:
        raise _refuse(f"the adapter archive has more than {MAX_MEMBERS} members")


def _extract_members(members: list[_Member], dest: Path, max_bytes: int) -> None:
    total = 0
    for member in members:
        _safe_relative(member.name)
        if not member.is_regular:
            raise _refuse(f"archive member {member.name!r} is a link or a special file")
        total += member.size
        if total > max_bytes:
            raise _refuse(f"archive content exceeds {max_bytes} bytes")
    for member in members:
        target = dest / _safe_relative(member.name)
        if member.is_dir:
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with member.open() as src, open(target, "wb") as out:
            _copy_at_most(src, out, member.size)


def _copy_at_most(src: BinaryIO, out: BinaryIO, size: int) -> None:
    """Copy the declared size and no more: a lying header cannot inflate past the checked total."""
    left = size
    while left > 0:
        block = src.read(min(left, 1 << 20))
        if not block:
            break
        out.write(block)
        left -= len(block)


def find_adapter_dir(root: Path) -> Path:
    """The directory holding adapter_config.json: the archive's root or its single top-level folder."""
    if (root / "adapter_config.json").is_file():
        return root
    subdirs = [p for p in root.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and (subdirs[0] / "adapter_config.json").is_file():
        return subdirs[0]
    raise AdapterSourceError("the downloaded adapter has no adapter_config.json at its root or in a single "
                             "top-level folder", param="lora_path", code="adapter_not_found",
                             is_transient=False)  # the archive's bytes were read: the same bytes, the same failure
