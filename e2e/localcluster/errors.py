"""What `e2e/cluster` reports on failure: the component, its log file and the log's last lines, no traceback."""
from __future__ import annotations

from pathlib import Path

NUM_TAIL_LINES = 12


class ClusterError(Exception):
    """A failure `e2e/cluster` explains in one message (the cli prints it and exits 1)."""


def tail(path: Path, num_lines: int = NUM_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-num_lines:])


def describe_exit(name: str, pid: int, log_path: Path) -> str:
    return f"{name} (pid {pid}) exited during start-up; its log: {log_path}; last lines:\n{tail(log_path)}"
