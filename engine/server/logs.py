"""Structured logs: one JSON object per line and per event (`event` names it, the rest are its fields).

    log_event(log, "adapter_loaded", adapter="a", revision="3f2c", seconds=0.41)
    -> {"ts": "2026-...Z", "level": "info", "logger": "kubelora.engine.server", "event": "adapter_loaded", ...}
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


def configure_logging(level: str) -> None:
    """JSON lines on stderr for every logger (ours, aiohttp's, the engine's)."""
    install_json_handler(level)
    # aiohttp's access log duplicates our request events.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn(...) becomes a JSON line too
    _route_transformers_logs()


def install_json_handler(level: str) -> None:
    """Only the root handler and level: torch-free callers (the router) use this without `configure_logging`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _route_transformers_logs() -> None:
    """transformers has its own stderr handler and progress bars; send its records through ours instead."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
