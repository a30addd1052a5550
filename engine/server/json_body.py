"""A request body's bytes -> one JSON object, within bounds on its shape, without stalling the event loop.

Every body: at most `MAX_JSON_DEPTH` levels of arrays and objects, at most `MAX_JSON_CONTAINERS` of them and
`MAX_JSON_STRINGS` string values (keys aside), no NaN/Infinity, no lone UTF-16 surrogate in any string or key
(400 naming the field). `check_tree` holds JSON decoded from a field's text (tool-call arguments) to the same.

json's C decoder holds the GIL from start to end. Small bodies take it anyway (milliseconds at most). A large body
is decoded on a worker thread (`fields.parse_body`), and how depends on what its bytes could hold: through the
C decoder with Python hooks at every number and object (the GIL goes to the loop every 5 ms at each hook) when
its `[`, `{` and `"` bytes bound the hookless work (containers and strings) to a few tens of milliseconds; else
through json's pure-Python scanner, which hands the GIL over at every value and stops at the first limit passed.
15 MiB of empty arrays took 1.6 s of held GIL in the C decoder; the Python scanner refuses them after 64 Ki.
Before either, a large body with few quotes has its arrays and objects counted exactly from its bytes (the `[`
and `{` outside strings, found by C-speed byte searches between its quotes), and is refused when they pass
MAX_JSON_CONTAINERS without any parse.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from typing import Any

from kubelora.contract.errors import InvalidRequest

MAX_JSON_DEPTH = 64  # nested arrays and objects, the body itself included
MAX_JSON_CONTAINERS = 65536  # arrays and objects in one body
MAX_JSON_STRINGS = 262144  # string values in one body (a request's fields hold a few thousand at most)
# A large body goes through the C decoder only when its bytes bound what it could hold without a hook: about
# 5 ms of held GIL per 20 Ki empty containers and 30 ms per 1 Mi short strings.
MAX_HOOKLESS_CONTAINERS = 32768
MAX_HOOKLESS_QUOTES = 2 << 20
# Bodies with at most this many quotes get their containers counted before any parse (a search per quote).
MAX_COUNTED_QUOTES = 4096


def check_text(value: str, field: str) -> str:
    """`value`, or 400 when it holds a lone surrogate (JSON's "\\ud800" escapes decode to one): such a string
    has no UTF-8 form, so neither the tokenizer, a chat template nor a response could carry it."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"'{field}' holds a lone UTF-16 surrogate at character {exc.start}; text must be "
                             "valid Unicode", param=field, code="invalid_value") from None
    return value


def decode_json_object(raw: bytes, *, is_large: bool = False) -> dict[str, Any]:
    """The body as a dict, checked by `check_tree`. is_large: on a worker thread (see the module doc)."""
    try:
        if not is_large:
            body = json.loads(raw, parse_constant=_refuse_constant)
        elif (count_containers(raw) or 0) > MAX_JSON_CONTAINERS:
            raise _too_many()
        elif _is_hookless_work_bounded(raw):
            body = json.loads(raw, parse_constant=_refuse_constant, **_YIELDING_HOOKS)
        else:
            body = _BoundedScan().decode(raw)
    except InvalidRequest:
        raise
    except RecursionError:  # the C decoder's guard: ~1000 levels of arrays or objects
        raise _too_deep() from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more than 4300 digits
        raise InvalidRequest(f"request body is not valid JSON: {exc}", param=None, code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}", param=None,
                             code="invalid_json")
    check_tree(body)
    return body


def check_tree(body: dict | list, field: str = "") -> None:
    """400 for a body nested deeper than MAX_JSON_DEPTH, with more than MAX_JSON_CONTAINERS arrays and objects or
    MAX_JSON_STRINGS strings, or with a lone surrogate in any string or key (`param` its path, e.g.
    `tools[0].function.parameters.x`). field: the path of `body` inside the request ("" for the body itself)."""
    num_containers = num_strings = 0
    stack: list[tuple[Any, tuple, int]] = [(body, (field,) if field else (), 1)]
    while stack:
        value, path, depth = stack.pop()
        num_containers += 1
        if num_containers > MAX_JSON_CONTAINERS:
            raise _too_many()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        for key, item in (value.items() if type(value) is dict else enumerate(value)):
            if type(key) is str and not key.isascii():
                check_text(key, field_name(path) or "request body")
            kind = type(item)
            if kind is str:
                num_strings += 1
                if num_strings > MAX_JSON_STRINGS:
                    raise _too_many()
                if not item.isascii():
                    check_text(item, field_name(path + (key,)))
            elif kind is dict or kind is list:
                stack.append((item, path + (key,), depth + 1))


def field_name(path: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (a leading field name is taken as written)."""
    name = ""
    for key in path:
        name += f"[{key}]" if isinstance(key, int) else (f".{key}" if name else key)
    return name


def count_containers(raw: bytes) -> int | None:
    """The `[` and `{` bytes outside strings: in valid JSON, its arrays and objects. None (not counted) when the
    body has more than MAX_COUNTED_QUOTES quotes or a quote after a backslash (an escaped quote, or a string
    ending in one: the bytes alone leave it open which)."""
    if raw.count(b'"') > MAX_COUNTED_QUOTES:
        return None
    count, start, is_outside = 0, 0, True
    while (quote := raw.find(b'"', start)) >= 0:
        if quote and raw[quote - 1] == 0x5C:
            return None
        if is_outside:
            count += raw.count(b"[", start, quote) + raw.count(b"{", start, quote)
        start, is_outside = quote + 1, not is_outside
    if is_outside:
        count += raw.count(b"[", start) + raw.count(b"{", start)
    return count


def _is_hookless_work_bounded(raw: bytes) -> bool:
    # Upper bounds: brackets and quotes inside strings count too, which only sends more bodies to the scanner.
    return (raw.count(b"[") + raw.count(b"{") <= MAX_HOOKLESS_CONTAINERS
            and raw.count(b'"') <= MAX_HOOKLESS_QUOTES)


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"request body is not valid JSON here: arrays and objects are nested too deeply (at most "
                          f"{MAX_JSON_DEPTH} levels)", param=None, code="invalid_json")


def _too_many() -> InvalidRequest:
    return InvalidRequest(f"request body holds more than {MAX_JSON_CONTAINERS} arrays and objects or more than "
                          f"{MAX_JSON_STRINGS} strings", param=None, code="out_of_range")


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN, Infinity and -Infinity; JSON (and OpenAI) does not.
    raise InvalidRequest(f"request body is not valid JSON: {name} is not a JSON number", param=None,
                         code="invalid_json")


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


_YIELDING_HOOKS = {"parse_int": _int, "parse_float": _float, "object_pairs_hook": _object}


class _BoundedScan:
    """json's pure-Python scanner (`json.scanner.py_make_scanner` reads its parsing settings from this object),
    counting arrays, objects and strings as it reads them: the body is refused at the first one over a limit."""

    strict = True
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_refuse_constant)
    object_hook = None
    object_pairs_hook = None

    def __init__(self) -> None:
        self.memo: dict = {}
        self._depth = 0
        self._num_containers = self._num_strings = 0
        self._decoder = json.JSONDecoder()
        self._decoder.scan_once = json.scanner.py_make_scanner(self)

    def decode(self, raw: bytes) -> Any:
        return self._decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))

    def parse_object(self, s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo):
        self._enter()
        try:
            return json.decoder.JSONObject(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo)
        finally:
            self._depth -= 1

    def parse_array(self, s_and_end, scan_once):
        self._enter()
        try:
            return json.decoder.JSONArray(s_and_end, scan_once)
        finally:
            self._depth -= 1

    def parse_string(self, text: str, end: int, strict: bool) -> tuple[str, int]:
        self._num_strings += 1
        if self._num_strings > MAX_JSON_STRINGS:
            raise _too_many()
        return json.decoder.scanstring(text, end, strict)

    def _enter(self) -> None:
        self._depth += 1
        self._num_containers += 1
        if self._depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if self._num_containers > MAX_JSON_CONTAINERS:
            raise _too_many()
