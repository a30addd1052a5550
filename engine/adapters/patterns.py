"""PEFT's per-module pattern keys (`alpha_pattern`, `rank_pattern`) matched in linear time.

PEFT (`peft.utils.other.get_pattern_key`) picks, for a module's full name, the first key in order for which
`re.match(rf"(.*\\.)?({key})$", name)` holds: the key matches the whole name, or its end after a dot. Here the
same expression is compiled by RE2, whose matching time is linear in the name whatever the key: the keys come
from tenants, and a backtracking engine runs a key such as `(.|.){0,24}!` for seconds per name while holding
the GIL. A key RE2 cannot compile (backreferences, lookarounds, a repetition past its limits) is refused.

Each compile or match is one short call that holds the GIL (about 5 to 80 us), but a load makes up to
MAX_PATTERN_KEYS x modules of them in a row on its worker thread: CPython hands the GIL to a waiting thread only
every 5 ms, so the engine thread, which gives it up at every torch op, waits up to 5 ms for each one. `_Pacer`
rests the loading thread after every stretch of work, so the engine thread takes the GIL at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import re2

from kubelora.engine.adapters.safetensors_header import json_excerpt
from kubelora.engine.errors import AdapterCorrupt, InvalidAdapter

# Keys per pattern map. PEFT configs carry a few keys, or one per module name they cover (7 per layer: 36 layers
# at this bound). Each module name is matched against the keys in order, so a load's matching grows with
# keys x modules: at this bound a slow key costs ~75 us to compile and a module name ~1.3 ms to look up.
MAX_PATTERN_KEYS = 256
_MAX_REGEX_BYTES = 1 << 20  # RE2's memory for one compiled key; larger ones fail to compile and are refused
# The loading thread works at most _WORK_S of pattern calls in a row, then sleeps _REST_S (GIL released): a
# third of a core at most, so a load beside traffic leaves the engine thread the GIL and most of a core.
_WORK_S = 0.001
_REST_S = 0.002
_CALLS_PER_CLOCK = 16  # calls between reads of the clock


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a refused key is the tenant's error, reported in the answer, not in stderr
    options.max_mem = _MAX_REGEX_BYTES
    return options


_OPTIONS = _options()


@dataclass(frozen=True)
class PatternMap:
    """One config field's keys, compiled, with their values, in the config's order."""

    entries: tuple[tuple[object, object], ...] = ()  # (compiled key, value)

    def lookup(self, module_name: str, default):
        """The value of the first key matching `module_name` as PEFT matches it, else `default`."""
        pacer = _Pacer()
        name = module_name.encode()  # RE2 matches UTF-8: encoded once here, not once per key
        for regex, value in self.entries:
            if regex.match(name) is not None:
                return value
            pacer.tick()
        return default


class _Pacer:
    """Counts pattern calls; every _WORK_S of them the calling thread sleeps _REST_S (see the module doc)."""

    def __init__(self) -> None:
        self._num_calls = 0
        self._since = time.perf_counter()

    def tick(self) -> None:
        self._num_calls += 1
        if self._num_calls % _CALLS_PER_CLOCK:
            return
        if time.perf_counter() - self._since >= _WORK_S:
            time.sleep(_REST_S)
            self._since = time.perf_counter()


def compile_patterns(adapter: str, field: str, patterns: object, is_rank: bool) -> PatternMap:
    """`patterns` (the config's value of `field`, absent: None) checked and compiled.

    is_rank: values must be positive integers (rank_pattern), else finite numbers (alpha_pattern). A NaN or
    infinite value is `AdapterCorrupt`; any other wrong value, a key RE2 refuses, or too many keys is
    `InvalidAdapter`.
    """
    if patterns is None:
        return PatternMap()
    if not isinstance(patterns, dict):
        raise InvalidAdapter(adapter, field, f"must be an object, got {json_excerpt(patterns)}",
                             limit="{pattern: number}")
    if len(patterns) > MAX_PATTERN_KEYS:
        raise InvalidAdapter(adapter, field, f"has {len(patterns)} keys; it may have at most {MAX_PATTERN_KEYS}", limit=f"<= {MAX_PATTERN_KEYS} keys")
    entries = []
    pacer = _Pacer()
    for key, value in patterns.items():
        check_number(adapter, field, value, is_rank, what=f"{json_excerpt(key)} maps to")
        entries.append((_compile(adapter, field, key), value))
        pacer.tick()
    return PatternMap(tuple(entries))


def check_number(adapter: str, field: str, value: object, is_rank: bool, what: str = "is") -> None:
    """A positive integer (is_rank) or a finite number; booleans are neither. `what` leads the message."""
    if isinstance(value, float) and not math.isfinite(value):
        raise AdapterCorrupt(adapter, field, f"{what} {value}; it must be a finite number", limit="a finite number")
    limit = "a positive integer" if is_rank else "a number"
    is_number = not isinstance(value, bool) and isinstance(value, int if is_rank else (int, float))
    if not is_number or (is_rank and value < 1):
        raise InvalidAdapter(adapter, field, f"{what} {json_excerpt(value)}; it must be {limit}", limit=limit)


def _compile(adapter: str, field: str, key: str):
    try:
        return re2.compile(rf"(.*\.)?({key})$", _OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise InvalidAdapter(adapter, field, f"key {json_excerpt(key)} is not a regular expression RE2 accepts "
                             f"({reason})", limit="a regular expression without backreferences or lookarounds"
                             ) from None
