"""Status conditions (type, status, CamelCase reason, message, observedGeneration, lastTransitionTime)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_condition(type_: str, is_true: bool, reason: str, message: str, generation: int) -> dict:
    return {"type": type_, "status": "True" if is_true else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def merge_conditions(old: Iterable[dict] | None, new: Iterable[dict], now: str | None = None) -> list[dict]:
    """New conditions, keeping lastTransitionTime where a condition's status did not change."""
    previous = {c.get("type"): c for c in old or ()}
    merged = []
    for condition in new:
        before = previous.get(condition["type"])
        unchanged = before is not None and before.get("status") == condition["status"]
        stamp = before.get("lastTransitionTime") if unchanged else None
        merged.append({**condition, "lastTransitionTime": stamp or now or now_rfc3339()})
    return merged


def without_times(conditions: Iterable[dict] | None) -> list[dict]:
    """For change detection: conditions minus lastTransitionTime."""
    return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conditions or ()]


def build_status_patch(old: dict | None, new: dict, now: str | None = None) -> dict | None:
    """`new` with merged conditions, or None when it says nothing `old` does not (no write, no event)."""
    old = old or {}
    comparable_new = {**new, "conditions": without_times(new.get("conditions"))}
    comparable_old = {key: old.get(key) for key in new} | {"conditions": without_times(old.get("conditions"))}
    if comparable_new == comparable_old:
        return None
    return {**new, "conditions": merge_conditions(old.get("conditions"), new.get("conditions") or (), now)}
