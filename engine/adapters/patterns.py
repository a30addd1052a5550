"""PEFT's per-module pattern keys (`alpha_pattern`, `rank_pattern`) matched in linear time.

PEFT (`peft.utils.other.get_pattern_key`) picks, for a module's full name, the first key in order for which
`re.match(rf"(.*\\.)?({key})$", name)` holds: the key matches the whole name, or its end after a dot. Here the
same expression is compiled by RE2, whose matching time is linear in the name whatever the key: the keys come
from tenants, and a backtracking engine runs a key such as `(.|.){0,24}!` for seconds per name while holding
the GIL. A key RE2 cannot compile (backreferences, lookarounds, a repetition past its limits) is refused.

A compile holds the GIL for its whole call (about 5 us for a module name, a few ms for a key of large counted
repetitions); a match releases it inside RE2 but holds it for the Python around the call. A load makes up to
MAX_PATTERN_KEYS compiles and MAX_PATTERN_KEYS x modules matches in a row on its worker thread, and the engine
thread, which gives the GIL up at every torch op, needs it back between them: a step of a small model is mostly
Python, so it slows by the share of the GIL the loading thread takes. `_Pacer` bounds that share: after every
stretch of work the loading thread sleeps (GIL released) _REST_RATIO times as long as it worked.
"""

from __future__ import annotations

import dataclasses
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
# The loading thread rests once it has worked _WORK_S of pattern calls (or one call longer than that), for
# _REST_RATIO times its work: at most a fifth of the GIL and of a core, whatever one call costs.
_WORK_S = 0.001
_REST_RATIO = 4.0


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a refused key is the tenant's error, reported in the answer, not in stderr
    options.max_mem = _MAX_REGEX_BYTES
    return options


_OPTIONS = _options()


class _Pacer:
    """Counts one thread's pattern work and rests it (see the module doc).

    `start()` before a run of calls, `tick()` after each: past _WORK_S of work since the last rest, the thread
    sleeps _REST_RATIO times that work. Work carries over from one run to the next (the lookups of one load are
    many short runs), the time between runs does not. A clock read (under 0.1 us) costs little beside a call.
    """

    def __init__(self) -> None:
        self._worked_s = 0.0
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self._worked_s += now - self._last
        self._last = now
        if self._worked_s >= _WORK_S:
            time.sleep(self._worked_s * _REST_RATIO)
            self._worked_s = 0.0
            self._last = time.perf_counter()


@dataclass(frozen=True)
class PatternMap:
    """One config field's keys, compiled, with their values, in the config's order. Used by one loading thread:
    its pacer goes on from the compiles through every lookup."""

    entries: tuple[tuple[object, object], ...] = ()  # (compiled key, value)
    pacer: _Pacer = dataclasses.field(default_factory=_Pacer, compare=False, repr=False)

    def lookup(self, module_name: str, default):
        """The value of the first key matching `module_name` as PEFT matches it, else `default`."""
        self.pacer.start()
        name = module_name.encode()  # RE2 matches UTF-8: encoded once here, not once per key
        for regex, value in self.entries:
            if regex.match(name) is not None:
                return value
            self.pacer.tick()
        return default


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
    return PatternMap(tuple(entries), pacer)


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
