"""Virtual token counters (VTC-style) for fair admission across adapters.

Each adapter key (the adapter name; "" for the base model) accumulates the tokens the engine processed for it
(prompt chunks and generated tokens). Admission always tries the key with the smallest counter first. A key
that becomes active again is lifted to the smallest counter among active keys, so idle time is not banked:
a tenant cannot starve the others after a pause, and a flooding tenant cannot starve a trickling one.
"""

from __future__ import annotations


class FairShare:
    def __init__(self) -> None:
        self._counters: dict[str, float] = {}

    def counter(self, key: str) -> float:
        return self._counters.get(key, 0.0)

    def activate(self, key: str, active_keys: set[str]) -> None:
        """`key` had nothing waiting or running and gets a request: lift it to the active minimum."""
        others = [self._counters.get(k, 0.0) for k in active_keys if k != key]
        floor = min(others) if others else self._counters.get(key, 0.0)
        self._counters[key] = max(self._counters.get(key, 0.0), floor)

    def charge(self, key: str, num_tokens: int) -> None:
        self._counters[key] = self._counters.get(key, 0.0) + num_tokens

    def forget(self, keys_to_keep: set[str]) -> None:
        """Drop counters of keys that are gone (bounded memory with many short-lived adapters)."""
        self._counters = {k: v for k, v in self._counters.items() if k in keys_to_keep}
