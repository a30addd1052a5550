"""Typed reads of one JSON object: every error names the field and what was expected.

A `Fields` wraps the decoded body; each `take_*` consumes one key; `finish()` refuses the keys nobody took
(OpenAI answers unknown arguments with 400 too, and a typo such as `max_token` must not pass silently).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from kubelora.contract.errors import InvalidRequest
from kubelora.engine.server.json_body import check_text, decode_json_object

__all__ = ["Fields", "check_text", "parse_body"]

_MISSING = object()
T = TypeVar("T")
MAX_INLINE_BODY_BYTES = 64 << 10  # larger bodies are decoded off the event loop (json_body.py)
# One thread for every large body: two decodes at once would share the GIL with each other as well as with the
# loop. After each body the thread rests as long as it worked, up to MAX_REST_S, so that back-to-back bodies leave
# the loop whole stretches of GIL time.
_LARGE_BODIES = ThreadPoolExecutor(1, "kubelora-json")
MAX_REST_S = 0.05


async def parse_body(request: web.Request, parse: Callable[[dict[str, Any]], T]) -> T:
    """`parse(decode_json_object(body))`; a large body is decoded and parsed on a worker thread, where the
    Python-level checks of a long token array hand the GIL back to the event loop every few milliseconds."""
    raw = await request.read()
    if len(raw) <= MAX_INLINE_BODY_BYTES:
        return parse(decode_json_object(raw))
    return await asyncio.get_running_loop().run_in_executor(_LARGE_BODIES, _parse_large, raw, parse)


def _parse_large(raw: bytes, parse: Callable[[dict[str, Any]], T]) -> T:
    started = time.monotonic()
    try:
        return parse(decode_json_object(raw, is_large=True))
    finally:
        time.sleep(min(time.monotonic() - started, MAX_REST_S))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _type_error(field: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"'{field}' must be {expected}, got {_kind(value)}", param=field, code="invalid_type")


def _range_error(field: str, limit: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"'{field}' must be {limit}, got {value!r}", param=field, code="out_of_range")


class Fields:
    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self._body = body
        self._prefix = prefix
        self._taken: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self._prefix}{key}"

    def _raw(self, key: str, required: bool) -> Any:
        self._taken.add(key)
        value = self._body.get(key, _MISSING)
        if value is _MISSING and required:
            raise InvalidRequest(f"'{self.name(key)}' is required", param=self.name(key), code="missing_field")
        return value

    def take_any(self, key: str, *, required: bool = False) -> Any:
        value = self._raw(key, required)
        return None if value is _MISSING else value

    def take_str(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self._raw(key, required)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, str):
            raise _type_error(self.name(key), "a string", value)
        return check_text(value, self.name(key))

    def take_bool(self, key: str, default: bool) -> bool:
        value = self._raw(key, False)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, bool):
            raise _type_error(self.name(key), "a boolean", value)
        return value

    def take_int(self, key: str, default: int | None, *, low: int | None = None,
                 high: int | None = None) -> int | None:
        value = self._raw(key, False)
        if value is _MISSING or value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(self.name(key), "an integer", value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _range_error(self.name(key), _bounds(low, high), value)
        return value

    def take_float(self, key: str, default: float, *, low: float, high: float, low_open: bool = False) -> float:
        value = self._raw(key, False)
        if value is _MISSING or value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(self.name(key), "a number", value)
        if not low <= value <= high or (low_open and value == low):  # NaN fails every comparison
            interval = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
            raise _range_error(self.name(key), interval, value)
        return float(value)

    def take_list(self, key: str, *, required: bool = False) -> list | None:
        value = self._raw(key, required)
        if value is _MISSING or value is None:
            return None
        if not isinstance(value, list):
            raise _type_error(self.name(key), "an array", value)
        return value

    def take_object(self, key: str) -> Fields | None:
        value = self._raw(key, False)
        if value is _MISSING or value is None:
            return None
        if not isinstance(value, dict):
            raise _type_error(self.name(key), "an object", value)
        return Fields(value, prefix=f"{self.name(key)}.")

    def take_unsupported(self, key: str, *allowed: Any) -> None:
        """An OpenAI argument we accept only at its neutral value (e.g. n=1, echo=false)."""
        value = self._raw(key, False)
        if value is _MISSING or value is None or any(_is_same_value(value, a) for a in allowed):
            return
        shown = " or ".join(json.dumps(a) for a in allowed)
        raise InvalidRequest(f"'{self.name(key)}' is not supported by this server (only {shown} or null), "
                             f"got {json.dumps(value)}", param=self.name(key), code="unsupported_value")

    def finish(self) -> None:
        unknown = sorted(set(self._body) - self._taken)
        if unknown:
            field = self.name(unknown[0])
            raise InvalidRequest(f"unknown field '{field}'", param=field, code="unknown_field")


def _is_same_value(value: Any, allowed: Any) -> bool:
    """Equal and of the same JSON type; an integral number (1.0) stands for an integer (1), as in take_int."""
    if isinstance(allowed, int) and not isinstance(allowed, bool) and isinstance(value, float):
        return value == allowed
    return value == allowed and type(value) is type(allowed)


def _bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"
