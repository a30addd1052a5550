"""What each `kubelora bench` command does around its run: its work folder and its report, printed and written."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def work_folder(command: str, given: str | Path | None) -> Iterator[Path]:
    """The folder named by --workdir (made if missing, kept), else a temporary one removed after the run."""
    if given is not None:
        folder = Path(given)
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix=f"kubelora-bench-{command}-") as tmp:
        yield Path(tmp)


def publish(text: str, path: str | Path | None) -> None:
    """The markdown report to stdout, and to `path` when given (--write)."""
    print(text, flush=True)
    if path:
        Path(path).write_text(text)


def refuse(command: str, exc: Exception) -> int:
    """A configuration the command refuses: said on stdout, exit status 2."""
    print(f"kubelora bench {command}: {exc}", flush=True)
    return 2
