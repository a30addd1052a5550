"""An adapter's files opened only when they are regular files.

The path comes from a tenant: it may name a directory, a FIFO (whose open blocks until a writer appears, forever
on a load), a socket or a device. The file is opened without blocking and checked with fstat on the open
descriptor (no window between the check and the open), then read as a plain blocking file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from kubelora.engine.errors import AdapterNotFound, InvalidAdapter

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def open_regular(adapter: str, path: Path) -> BinaryIO:
    """`path` opened for reading; `InvalidAdapter` unless it is a regular file, `AdapterNotFound` if missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AdapterNotFound(adapter, path.name, f"{str(path)!r} does not exist", limit="a readable file") from None
    except OSError as exc:  # e.g. a socket (ENXIO) or no permission
        _refuse_special(adapter, path)
        raise AdapterNotFound(adapter, path.name, f"cannot read {str(path)!r}: {exc}", limit="a readable file") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(adapter, path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _refuse_special(adapter: str, path: Path) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(adapter, path, mode)


def _not_regular(adapter: str, path: Path, mode: int) -> InvalidAdapter:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return InvalidAdapter(adapter, path.name, f"{str(path)!r} is {kind}", limit="a regular file")
