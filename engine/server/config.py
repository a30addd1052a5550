"""Server settings: one frozen `ServerConfig`, from command-line flags first and `KUBELORA_*` variables second.

Every setting has one row in `SETTINGS` (flag, environment variable, parser, default); `add_arguments` and
`resolve_config` both loop over that table, and docs/server.md lists the same rows.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kubelora.engine import settings
from kubelora.engine.settings import Setting, parse_bool

ENV_PREFIX = "KUBELORA_"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Adapter names appear in URLs, metric labels and Kubernetes status: keep them to a safe alphabet.
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")


# Every row gets the server's prefix; the router binds its own.
_setting = functools.partial(Setting, env_prefix=ENV_PREFIX)


def _lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


SETTINGS: tuple[Setting, ...] = (
    _setting("--model", str, "base model directory (Hugging Face layout, safetensors)"),
    _setting("--served-model-name", str, "name clients use for the base model (default: the model directory's name)"),
    _setting("--lora", _lora, "adapter to load at start, NAME=PATH (repeatable)", is_list=True),
    _setting("--max-loras", int, "distinct adapters in one batch (adapter slots on the device)"),
    _setting("--max-lora-rank", int, "largest adapter rank accepted"),
    _setting("--max-cpu-loras", int, "adapters kept in host memory (LRU)"),
    _setting("--max-model-len", int, "prompt plus completion tokens per request"),
    _setting("--max-num-seqs", int, "sequences in one batch", default=64),
    _setting("--max-waiting-requests", int, "queued requests before 429", default=1024),
    _setting("--max-lora-pool-bytes", int, "device adapter pool budget (default: max-loras x max-lora-rank rows)"),
    _setting("--strict-base-model", parse_bool, "refuse adapters whose base_model_name_or_path names another model",
             default=False, is_switch=True),
    _setting("--device", str, "cpu, cuda or cuda:N", default="cpu"),
    _setting("--dtype", str, "weights dtype: auto, float32, float16, bfloat16", default="auto"),
    _setting("--host", str, "listen address", default="0.0.0.0"),
    _setting("--port", int, "listen port", default=8000),
    _setting("--admin-token-file", str, "file holding the bearer token for the adapter admin endpoints"),
    _setting("--adapter-root", str, "directory local adapter paths must lie under (repeatable)", is_list=True),
    _setting("--adapter-url-host", str, "host[:port] adapter URLs may name (repeatable)", is_list=True),
    _setting("--adapter-cache-dir", str, "where downloaded adapters are stored", default="/tmp/kubelora-adapters"),
    _setting("--max-adapter-bytes", int, "largest adapter download or archive content", default=2 << 30),
    _setting("--log-level", str, "debug, info, warning or error", default="info"),
)
REQUIRED = ("model", "max_loras", "max_lora_rank", "max_cpu_loras", "max_model_len")


@dataclass(frozen=True)
class ServerConfig:
    model: str
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    max_model_len: int
    served_model_name: str | None = None  # None: the engine's name for the model (its directory's name)
    lora: tuple[tuple[str, str], ...] = ()
    max_num_seqs: int = 64
    max_waiting_requests: int = 1024
    max_lora_pool_bytes: int | None = None
    strict_base_model: bool = False
    device: str = "cpu"
    dtype: str = "auto"
    host: str = "0.0.0.0"
    port: int = 8000
    admin_token: str | None = field(default=None, repr=False)
    adapter_root: tuple[str, ...] = ()
    adapter_url_host: tuple[str, ...] = ()
    adapter_cache_dir: str = "/tmp/kubelora-adapters"
    max_adapter_bytes: int = 2 << 30
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "max_model_len", "max_num_seqs",
                     "max_waiting_requests", "max_adapter_bytes", "max_lora_pool_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin token must not be empty")
        names = [name for name, _ in self.lora]
        for name in names:
            if not ADAPTER_NAME_RE.match(name) or name == self.served_model_name:
                raise ValueError(f"lora name {name!r} must match {ADAPTER_NAME_RE.pattern} and differ from the base")
        if len(set(names)) != len(names):
            raise ValueError(f"lora names must be unique, got {names}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, SETTINGS)


def _from_env(s: Setting, environ: Mapping[str, str]) -> object:
    raw = environ.get(s.env)
    if raw is None or raw.strip() == "":
        return None
    try:
        if s.is_list:
            return [s.parse(item.strip()) for item in raw.split(",") if item.strip()]
        return s.parse(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{s.env}: {exc}") from None


def _read_token(path: str | None, environ: Mapping[str, str]) -> str | None:
    if path is None:
        return environ.get(ENV_PREFIX + "ADMIN_TOKEN") or None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"admin token file {path} is empty")
    return token


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags win over environment variables, which win over defaults. Raises ValueError naming the setting."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for s in SETTINGS:
        value = settings.given_value(s, args, environ, _from_env)
        if value is None:
            value = s.default
        if s.is_list:
            value = tuple(value or ())
        values[s.dest] = value
    missing = [f"--{name.replace('_', '-')} (or {ENV_PREFIX}{name.upper()})" for name in REQUIRED
               if values[name] is None]
    if missing:
        raise ValueError(f"missing required settings: {', '.join(missing)}")
    values["admin_token"] = _read_token(values.pop("admin_token_file"), environ)
    return ServerConfig(**values)
