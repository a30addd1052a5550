"""Router settings: one frozen `RouterConfig`, from flags first, `KUBELORA_ROUTER_*` variables second, defaults last.

Every setting is one row of `SETTINGS`; `add_arguments`, `resolve_config` and docs/router.md follow that table.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kubelora.contract import settings
from kubelora.contract.settings import Setting

ENV_PREFIX = "KUBELORA_ROUTER_"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Where Kubernetes mounts the pod's service account; its `namespace` file is the default namespace.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


_setting = functools.partial(Setting, env_prefix=ENV_PREFIX)

SETTINGS: tuple[Setting, ...] = (
    _setting("--pool", str, "LoRAPool name (labels, logs; default ConfigMap name <pool>-placement)"),
    _setting("--namespace", str, "namespace of the pool (default: the service account's namespace)"),
    _setting("--placement-configmap", str, "ConfigMap holding placement.json (default: <pool>-placement)"),
    _setting("--placement-file", str, "read placement.json from this file instead of Kubernetes (tests, no cluster)"),
    _setting("--kubeconfig", str, "kubeconfig file (default: in-cluster config)"),
    _setting("--host", str, "listen address", default="0.0.0.0"),
    _setting("--port", int, "listen port (0: a free port)", default=8080),
    _setting("--load-factor", float, "a replica above load-factor x the average in-flight passes a request on",
             default=1.0),
    _setting("--poll-interval", float, "seconds between placement reads", default=1.0),
    _setting("--max-placement-age", float, "/ready answers 503 once no placement read has succeeded for this many "
             "seconds (0: never)", default=60.0),
    _setting("--connect-timeout", float, "seconds to connect to a replica before trying the next", default=5.0),
    _setting("--log-level", str, "debug, info, warning or error", default="info"),
)


@dataclass(frozen=True)
class RouterConfig:
    pool: str = ""
    namespace: str = "default"
    placement_configmap: str = ""
    placement_file: str | None = None
    kubeconfig: str | None = None
    host: str = "0.0.0.0"
    port: int = 8080
    load_factor: float = 1.0
    poll_interval: float = 1.0
    max_placement_age: float = 60.0
    connect_timeout: float = 5.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.placement_file and not self.placement_configmap:
            raise ValueError("pool: set --pool (or --placement-configmap), or --placement-file")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0 (1.0: strict balance), got {self.load_factor}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0.05 <= self.poll_interval <= 60:
            raise ValueError(f"poll_interval must be in [0.05, 60] seconds, got {self.poll_interval}")
        if self.max_placement_age != 0 and not self.poll_interval < self.max_placement_age <= 86400:
            raise ValueError(f"max_placement_age must be 0 (never) or in (poll_interval, 86400] seconds, got "
                             f"{self.max_placement_age}")
        if self.connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0 seconds, got {self.connect_timeout}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Untyped: `resolve_config` parses flag and environment text alike and names both in its error.
    settings.add_arguments(parser, SETTINGS, is_typed=False)


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """Flags win over the environment, which wins over the defaults. Raises ValueError naming the setting."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for setting in SETTINGS:
        text = settings.given_value(setting, args, environ)
        if text is None:
            continue
        try:
            values[setting.dest] = setting.parse(text)
        except ValueError:
            raise ValueError(f"{setting.flag} ({setting.env}): cannot parse {text!r}") from None
    if "namespace" not in values:
        values["namespace"] = _service_account_namespace()
    if "placement_configmap" not in values and values.get("pool"):
        values["placement_configmap"] = f"{values['pool']}-placement"
    return RouterConfig(**values)


def _service_account_namespace() -> str:
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"
