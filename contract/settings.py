"""Settings tables of the engine server, the router and the operator: one `Setting` row per flag and environment
variable.

Each entry point keeps its own table, env prefix and config dataclasses; this module only turns a table into
argparse flags and finds a setting's value (flag first, environment second). Stdlib only: the router must stay
torch-free.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    flag: str
    parse: Callable[[str], object]
    help: str
    default: object = None
    is_list: bool = False  # repeatable flag; comma-separated in the environment
    is_switch: bool = False  # --flag / --no-flag; true/false in the environment
    env_prefix: str = ""  # each table binds its own prefix (KUBELORA_, KUBELORA_ROUTER_, ...) with functools.partial
    config_field: str = ""  # the config field it fills, when its name differs from the flag's
    aliases: tuple[str, ...] = ()  # short spellings of the flag (-n)
    env_name: str = ""  # the variable's name after the prefix, when it is not the flag's (RESYNC_S)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def field_name(self) -> str:
        return self.config_field or self.dest

    @property
    def env(self) -> str:
        return self.env_prefix + (self.env_name or self.dest.upper())


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser, settings: tuple[Setting, ...], *, is_typed: bool = True) -> None:
    """Every flag defaults to None, so resolution can tell 'not given' from 'given'.

    `is_typed`: argparse parses flag values with `Setting.parse`; False keeps them text, for a caller that parses
    flag and environment text alike (and names both in its error).
    """
    for s in settings:
        help_text = f"{s.help} [env {s.env}]"
        if s.is_switch:
            parser.add_argument(s.flag, *s.aliases, dest=s.dest, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
            continue
        action = "append" if s.is_list else "store"
        parser.add_argument(s.flag, *s.aliases, dest=s.dest, type=s.parse if is_typed else None, action=action,
                            default=None, help=help_text)


def env_text(s: Setting, environ: Mapping[str, str]) -> str | None:
    """The variable's text; None when it is unset or empty (the chart renders unset values as "")."""
    return environ.get(s.env) or None


def env_value(s: Setting, environ: Mapping[str, str]) -> object:
    """The variable parsed with `Setting.parse` (each comma-separated item for a list); None when it is unset or
    empty. ValueError names the variable."""
    text = env_text(s, environ)
    if text is None or not text.strip():
        return None
    try:
        if s.is_list:
            return [s.parse(item.strip()) for item in text.split(",") if item.strip()]
        return s.parse(text.strip())
    except ValueError as exc:
        raise ValueError(f"{s.env}: {exc}") from None


def given_value(s: Setting, args: argparse.Namespace, environ: Mapping[str, str],
                read_env: Callable[[Setting, Mapping[str, str]], object] = env_text) -> object:
    """The flag's value if given, else `read_env`'s; None when neither is set (the caller picks the default)."""
    value = getattr(args, s.dest, None)
    return read_env(s, environ) if value is None else value
