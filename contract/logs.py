"""Structured logs: one JSON object per line and per event (`event` names it, the rest are its fields).

    log_event(log, "adapter_loaded", adapter="a", revision="3f2c", seconds=0.41)
    -> {"ts": "2026-...Z", "level": "info", "logger": "kubelora.engine.server", "event": "adapter_loaded", ...}

Stdlib only: the server and the router both log this way.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = "kubelora_fields"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, _FIELDS, None)
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        if fields is None:
            line["event"] = "log"
            line["message"] = record.getMessage()
        else:
            line.update(fields)
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={_FIELDS: {"event": event, **fields}})


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when a record is written, not the object it was at install.

    An entry point called in-process (the CLI's tests) installs the root handler while sys.stderr is a captured
    stream that pytest swaps back and closes after the test; a handler bound to it would fail on every later
    record ("ValueError: I/O operation on closed file"). The stdlib's own last-resort handler works the same way.
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler.__init__ would assign the stream

    @property
    def stream(self):
        return sys.stderr


def install_json_handler(level: str) -> None:
    """JSON lines on stderr for every logger: one root handler at `level`."""
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

