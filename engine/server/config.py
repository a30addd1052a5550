"""Server settings: one frozen `ServerConfig` holding its `EngineConfig`, from command-line flags first and
`KUBELORA_*` variables second.

Every setting has one row in `SETTINGS` (flag, environment variable, parser, default); `add_arguments` and
`resolve_config` both loop over that table, and docs/server.md lists the same rows. A row whose field is an
`EngineConfig` field fills the engine's config; the others fill the server's.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from kubelora.contract import settings
from kubelora.contract.settings import Setting, parse_bool
from kubelora.contract.sources import check_host_pattern, normalize_endpoint
from kubelora.engine.config import EngineConfig

ENV_PREFIX = "KUBELORA_"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Adapter names appear in URLs, metric labels and Kubernetes status: keep them to a safe alphabet.
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
ADAPTER_NAME_RULE = f"{ADAPTER_NAME_RE.pattern}, with no empty, '.' or '..' segment between slashes"


def is_valid_adapter_name(name: str) -> bool:
    """ADAPTER_NAME_RULE: a name also ends up in URL paths, where `a/../../x` would name something else."""
    return ADAPTER_NAME_RE.fullmatch(name) is not None and all(s not in ("", ".", "..") for s in name.split("/"))


# Every row gets the server's prefix; the router binds its own.
_setting = functools.partial(Setting, env_prefix=ENV_PREFIX)


def _lower(text: str) -> str:
    return text.strip().lower()


def _lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


SETTINGS: tuple[Setting, ...] = (
    _setting("--model", str, "base model directory (Hugging Face layout, safetensors)", config_field="model_dir"),
    _setting("--served-model-name", str, "name clients use for the base model (default: the model directory's name)"),
    _setting("--lora", _lora, "adapter to load at start, NAME=PATH (repeatable)", is_list=True),
    _setting("--max-loras", int, "distinct adapters in one batch (default: as many as the device pool holds)"),
    _setting("--max-lora-rank", int, "largest adapter rank accepted"),
    _setting("--max-cpu-loras", int, "adapters kept in host memory (LRU)"),
    _setting("--max-model-len", int, "prompt plus completion tokens per request"),
    _setting("--max-num-seqs", int, "sequences in one batch"),
    _setting("--max-waiting-requests", int, "queued requests before 429", config_field="max_waiting"),
    _setting("--max-lora-pool-bytes", int, "device adapter pool budget (default: see docs/server.md)"),
    _setting("--strict-base-model", parse_bool, "refuse adapters whose base_model_name_or_path names another model",
             is_switch=True, config_field="is_base_model_strict"),
    _setting("--device", str, "cpu, cuda or cuda:N"),
    _setting("--dtype", str, "weights dtype: auto, float32, float16, bfloat16"),
    _setting("--enforce-eager", parse_bool, "run every step eagerly, without CUDA graphs", is_switch=True),
    _setting("--async-scheduling", parse_bool,
             "queue the next step before reading this one's tokens back (default: on CUDA)", is_switch=True),
    _setting("--gemv", parse_bool, "one-token steps on CUDA through the Triton GEMV (off: cuBLAS)", is_switch=True,
             config_field="use_gemv"),
    _setting("--prefill-graphs", parse_bool, "a lone sequence's short prefill replays a CUDA graph", is_switch=True,
             config_field="use_prefill_graphs"),
    _setting("--staged-shrink", parse_bool, "LoRA decode steps compute their shrink in the base matmul (Triton, CUDA)",
             is_switch=True, config_field="use_staged_shrink"),
    _setting("--enable-prefix-caching", parse_bool, "reuse the KV cache of full blocks of earlier requests with the "
             "same prefix, adapter revision and cache_salt (vLLM's flag)", is_switch=True),
    _setting("--lora-backend", _lower, "LoRA kernels: triton or torch (default: triton on CUDA, torch elsewhere)"),
    _setting("--blas", _lower, "CUDA matmul library: cublaslt or cublas", config_field="blas_library"),
    _setting("--host", str, "listen address", default="0.0.0.0"),
    _setting("--port", int, "serving port: the OpenAI API, the public model list, health, metrics", default=8000),
    _setting("--admin-port", int, "admin port: adapter load/unload and the operator's model list", default=8001),
    _setting("--admin-token-file", str, "file holding the bearer token for the adapter admin endpoints"),
    _setting("--require-api-keys", parse_bool, "serve only requests with a tenant API key of the table the operator "
             "pushes (PUT /v1/api_keys on the admin port)", is_switch=True),
    _setting("--adapter-root", str, "directory local adapter paths must lie under (repeatable)", is_list=True),
    _setting("--adapter-url-host", str, "host[:port] adapter URLs may name; `*` matches within one DNS label (repeatable)", is_list=True),
    _setting("--adapter-s3-bucket", str, "bucket (fnmatch pattern) s3:// adapter sources may name (repeatable)",
             is_list=True),
    _setting("--adapter-s3-endpoint", str, "http(s)://host[:port] of an S3-compatible server a load may name "
             "(repeatable)", is_list=True),
    _setting("--adapter-cache-dir", str, "where downloaded adapters are stored", default="/tmp/kubelora-adapters"),
    _setting("--max-adapter-bytes", int, "largest adapter download or archive content", default=2 << 30),
    _setting("--adapter-download-timeout", float, "seconds one adapter's download may take in all", default=600.0),
    _setting("--log-level", str, "debug, info, warning or error", default="info"),
)
# Rows named like an EngineConfig field fill it (EngineConfig keeps their defaults and range checks); the rest
# are the server's own.
ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))
# The engine's execution switches: also read from the environment by the entry points that build an EngineConfig
# without the server's flags (the offline rows of `kubelora bench engine`).
ENGINE_SWITCHES = ("--gemv", "--prefill-graphs", "--staged-shrink", "--lora-backend", "--blas")


def engine_switches_from_env(environ: Mapping[str, str]) -> dict[str, object]:
    """EngineConfig fields of the ENGINE_SWITCHES set in `environ` (KUBELORA_GEMV=0, KUBELORA_LORA_BACKEND=torch,
    KUBELORA_BLAS=cublas, ...)."""
    rows = [s for s in SETTINGS if s.flag in ENGINE_SWITCHES]
    return {s.field_name: s.parse(environ[s.env]) for s in rows if s.env in environ}
REQUIRED = ("--model", "--max-lora-rank", "--max-cpu-loras", "--max-model-len")


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    lora: tuple[tuple[str, str], ...] = ()
    host: str = "0.0.0.0"
    port: int = 8000
    admin_port: int = 8001  # the admin endpoints listen here only (docs/server.md, "Two ports")
    admin_token: str | None = field(default=None, repr=False)
    require_api_keys: bool = False
    adapter_root: tuple[str, ...] = ()
    adapter_url_host: tuple[str, ...] = ()
    adapter_s3_bucket: tuple[str, ...] = ()
    adapter_s3_endpoint: tuple[str, ...] = ()
    adapter_cache_dir: str = "/tmp/kubelora-adapters"
    max_adapter_bytes: int = 2 << 30
    adapter_download_timeout: float = 600.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        engine = self.engine
        if engine.max_loras is not None and engine.max_cpu_loras < engine.max_loras:
            raise ValueError(f"max_cpu_loras ({engine.max_cpu_loras}) must be >= max_loras ({engine.max_loras})")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", engine.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {engine.device!r}")
        if self.max_adapter_bytes < 1:
            raise ValueError(f"max_adapter_bytes must be >= 1, got {self.max_adapter_bytes}")
        if not self.adapter_download_timeout > 0:
            raise ValueError(f"adapter_download_timeout must be > 0 seconds, got {self.adapter_download_timeout}")
        for name in ("port", "admin_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.port == self.admin_port != 0:
            raise ValueError(f"admin_port must differ from port, both are {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin token must not be empty")
        for pattern in self.adapter_url_host:
            check_host_pattern(pattern)
        for endpoint in self.adapter_s3_endpoint:
            normalize_endpoint(endpoint)
        names = [name for name, _ in self.lora]
        for name in names:
            if not is_valid_adapter_name(name) or name == engine.served_model_name:
                raise ValueError(f"lora name {name!r} must match {ADAPTER_NAME_RULE} and differ from the base")
        if len(set(names)) != len(names):
            raise ValueError(f"lora names must be unique, got {names}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, SETTINGS)


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
        value = settings.given_value(s, args, environ, settings.env_value)
        if value is None:
            value = s.default
        if s.is_list:
            value = tuple(value or ())
        if value is not None:  # unset engine rows keep EngineConfig's defaults
            values[s.field_name] = value
    missing = [f"{s.flag} (or {s.env})" for s in SETTINGS if s.flag in REQUIRED and s.field_name not in values]
    if missing:
        raise ValueError(f"missing required settings: {', '.join(missing)}")
    engine = _engine_config({name: values.pop(name) for name in list(values) if name in ENGINE_FIELDS})
    admin_token = _read_token(values.pop("admin_token_file", None), environ)
    return ServerConfig(engine=engine, admin_token=admin_token, **values)


def _engine_config(values: dict[str, object]) -> EngineConfig:
    """EngineConfig's own checks, with the setting named as the operator wrote it."""
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        for s in SETTINGS:
            if str(exc).startswith(f"{s.field_name} "):
                raise ValueError(f"{s.flag} (or {s.env}): {exc}") from None
        raise
