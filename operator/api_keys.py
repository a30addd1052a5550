"""A pool's tenant API keys: read from its key Secrets, pushed to its engines, published to its routers.

The key Secrets are the pool namespace's Secrets labelled `kubelora.io/api-key-for: <pool>`
(kubelora.contract.keys says what they hold). Each pass of a pool that requires keys lists them and builds the
table of digests; the engines whose table differs (their admin list's `api_keys.fingerprint`) get it before the
placement that routes to them is published, and the placement carries it to the routers. The pool's daemon also
lists them every `POLL_S` (`watch_key_secrets`) and starts a pass when one changed: a revoked key stops working
within a few seconds, sooner than a mounted Secret volume would refresh. Keys stay in the operator's memory only;
a Secret that is refused (a short key, an unreadable field) gets a Warning event naming the reason, never the key.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

from kubelora.contract.keys import KEY_SECRET_LABEL, InvalidKeySecret, KeyTable, build_table, grant_from_secret
from kubelora.operator.kube import Kube, KubeError

log = logging.getLogger("kubelora.operator")
POLL_S = 1.0  # how often a pool that requires keys lists its key Secrets between passes


@dataclass(frozen=True)
class RefusedSecret:
    name: str
    uid: str | None
    reason: str
    message: str


@dataclass(frozen=True)
class PoolKeys:
    table: KeyTable
    refused: tuple[RefusedSecret, ...] = ()
    versions: frozenset[tuple[str, str]] = frozenset()  # (Secret name, resourceVersion) of each key Secret

    def status(self) -> dict:
        """The pool status's `apiKeys`: how many keys are in force and which Secrets were refused, why."""
        return {"required": self.table.required, "numKeys": len(self.table.grants),
                "refusedSecrets": [{"name": r.name, "reason": r.reason, "message": r.message} for r in self.refused]}


def _decoded(secret: dict) -> dict[str, str]:
    data = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            data[key] = base64.b64decode(value, validate=True).decode()
        except (binascii.Error, ValueError, UnicodeDecodeError):
            data[key] = "\0"  # unreadable: refused by the field's own check
    return data


def secret_versions(secrets: Iterable[dict]) -> frozenset[tuple[str, str]]:
    """(name, resourceVersion) of each Secret: what changes when one is created, edited or deleted."""
    return frozenset((s["metadata"]["name"], s["metadata"].get("resourceVersion", "")) for s in secrets)


def read_pool_keys(required: bool, secrets: Iterable[dict]) -> PoolKeys:
    """The table from the key Secrets (pure). A pool that requires no keys gets the open table whatever exists."""
    secrets = list(secrets)
    versions = secret_versions(secrets)
    if not required:
        return PoolKeys(KeyTable(), (), versions)
    grants, refused = [], []
    for secret in sorted(secrets, key=lambda s: s["metadata"]["name"]):
        try:
            grants.append(grant_from_secret(_decoded(secret)))
        except InvalidKeySecret as exc:
            refused.append(RefusedSecret(secret["metadata"]["name"], secret["metadata"].get("uid"), exc.reason,
                                         str(exc)))
    return PoolKeys(build_table(True, grants), tuple(refused), versions)


def engines_to_push(table: KeyTable, fingerprints: Mapping[str, str | None]) -> list[str]:
    """The pods (of those observed) whose engine holds another table than `table`."""
    want = table.fingerprint()
    return sorted(pod for pod, held in fingerprints.items() if held != want)


async def list_key_secrets(kube: Kube, namespace: str, pool: str) -> list[dict]:
    body = await kube.request("GET", Kube.object_path("Secret", namespace),
                              params={"labelSelector": f"{KEY_SECRET_LABEL}={pool}"})
    return body.get("items", [])


async def watch_key_secrets(kube: Kube, namespace: str, pool: str, known: Callable[[], frozenset | None],
                            on_change: Callable[[], None], poll_s: float = POLL_S) -> None:
    """Until cancelled: every `poll_s`, while the last pass found the pool requiring keys (`known()` is not None),
    list its key Secrets and call `on_change` when their versions differ from what that pass read."""
    while True:
        await asyncio.sleep(poll_s)
        versions = known()
        if versions is None:
            continue
        with contextlib.suppress(KubeError, aiohttp.ClientError, asyncio.TimeoutError):
            if secret_versions(await list_key_secrets(kube, namespace, pool)) != versions:
                on_change()


REFUSAL_EVENT_EVERY_S = 60.0  # at most one RequestsRefused event per adapter this often


@dataclass(frozen=True)
class RefusalMemory:
    seen: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # (router, model, status) -> its total
    pending: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # model -> status -> not yet told
    told_at: Mapping[str, float] = field(default_factory=dict)  # model -> time of its last event


def refusal_events(memory: RefusalMemory, totals: Mapping[str, Mapping[str, Mapping[str, int]]],
                   adapters: Iterable[str], now: float) -> tuple[dict[str, str], RefusalMemory]:
    """Pure: each router's refusal totals (router -> model -> status -> count since it started) -> the adapters'
    event messages due now (one per adapter and REFUSAL_EVENT_EVERY_S, counting what came since its last one) and
    the next memory. A total below what was seen is a restarted router: all of it is new. Never a key."""
    adapters = set(adapters)
    seen = dict(memory.seen)
    pending = {model: dict(by_status) for model, by_status in memory.pending.items() if model in adapters}
    for router, by_model in totals.items():
        for model, by_status in by_model.items():
            for status, total in by_status.items():
                before = seen.get((router, model, status), 0)
                seen[(router, model, status)] = total
                new = total - before if total >= before else total
                if new > 0 and model in adapters:
                    pending.setdefault(model, {})[status] = pending.get(model, {}).get(status, 0) + new
    messages, told_at = {}, dict(memory.told_at)
    for model, by_status in sorted(pending.items()):
        if by_status and now - told_at.get(model, float("-inf")) >= REFUSAL_EVENT_EVERY_S:
            parts = ", ".join(f"{count} x {status}" for status, count in sorted(by_status.items()))
            messages[model] = (f"{sum(by_status.values())} requests for it were refused on their API key ({parts}; "
                               "401: no valid key, 403: a key not granted it, 429: over the key's rates)")
            told_at[model] = now
            pending[model] = {}
    return messages, RefusalMemory(seen, {m: s for m, s in pending.items() if s}, told_at)
