"""Go tools the e2e tests run (MinIO, the kstatus reader), built once from pinned sources and cached.

`build_cached` prints what it builds, a line of progress every PROGRESS_EVERY_S and how long it took, as the
Kubernetes build does (e2e/localcluster/build.py): a cold build takes minutes and must not look like a hang.
go's own output (module downloads, errors) goes to a log beside the binary, shown on failure.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path.home() / ".cache" / "kubelora"
PROGRESS_EVERY_S = 30.0


def cached_path(name: str, source: Path, inputs: tuple[str, ...]) -> Path:
    """~/.cache/kubelora/<name>/<digest of the source files `inputs`>/<name>: a new pin is a new path."""
    digest = hashlib.sha256(b"".join((source / file).read_bytes() for file in inputs)).hexdigest()[:16]
    return CACHE / name / digest / name


def build_cached(name: str, source: Path, inputs: tuple[str, ...], target: str = ".", timeout_s: float = 1800,
                 hint: str = "a few minutes the first time") -> Path:
    """The cached binary of `go build target` in `source` (CGO off: static), built first when missing."""
    binary = cached_path(name, source, inputs)
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    log_path, partial = binary.with_suffix(".log"), binary.with_suffix(".partial")
    log(f"building {name} ({target} in {source}, pinned by its go.sum) into {binary}: {hint}")
    started = time.monotonic()
    # The compile cache only serves a rebuild of the same pin, which the cached binary makes moot: temporary.
    with tempfile.TemporaryDirectory(prefix="gocache-", dir=binary.parent) as gocache, open(log_path, "wb") as out:
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOCACHE": gocache}
        process = subprocess.Popen(["go", "build", "-o", str(partial), target], cwd=source, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        code = _wait(process, name, started, timeout_s, log_path)
    if code != 0:
        lines = log_path.read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"building {name} failed (go build exit {code}); log: {log_path}; last lines:\n"
                           + "\n".join(lines))
    partial.rename(binary)
    log(f"built {name} in {time.monotonic() - started:.0f} s")
    return binary


def _wait(process: subprocess.Popen, name: str, started: float, timeout_s: float, log_path: Path) -> int:
    while True:
        try:
            return process.wait(timeout=PROGRESS_EVERY_S)
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                process.kill()
                process.wait()
                raise TimeoutError(f"building {name} took over {timeout_s:.0f} s; log: {log_path}") from None
            log(f"still building {name}: {elapsed:.0f} s so far (log: {log_path})")


def log(message: str) -> None:
    print(f"[build] {message}", file=sys.stderr, flush=True)
