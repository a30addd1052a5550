"""Tenant API keys: what a key may call, how a key Secret reads, and the table the router and the engine enforce.

A pool that requires keys (`LoRAPool.spec.apiKeys.required`) serves only requests whose `Authorization: Bearer <key>`
names a key of one of its key Secrets (label `kubelora.io/api-key-for: <pool>`):

    stringData:
      key: <at least 32 random bytes: `openssl rand -hex 32` or `openssl rand -base64 32`>
      adapters: tenant-a-chat, tenant-a-sql     # the adapters it may call (comma or newline separated)
      baseModel: "false"                       # whether it may call the base model
      requestsPerMinute: "600"                 # optional, per router replica
      tokensPerMinute: "200000"                # optional, per router replica

The operator reads the Secrets and hands out only each key's SHA-256 digest, in a `KeyTable`: with the placement
to the routers, over the admin API to the engines. No data-plane pod reads Secrets and no key travels. A key has at
least 32 random bytes, so its digest reveals nothing that would let anyone call with it.

A request's key is hashed and looked up by digest. The digest of a guess is not under the guesser's control, so
the lookup's timing tells nothing about any key; the matched digest is compared again with
`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kubelora.contract.errors import PermissionDenied, Unauthorized

KEY_SECRET_LABEL = "kubelora.io/api-key-for"  # its value names the pool the key calls
MIN_KEY_BYTES = 32
MAX_KEY_CHARS = 512
MAX_HEADER_CHARS = 8 + MAX_KEY_CHARS  # "Bearer " and the key; a longer Authorization header is refused unread
MAX_GRANTED = 4096  # adapters one key may name
_HEX = set(string.hexdigits)
_TOKEN_CHARS = set(string.ascii_letters + string.digits + "+/=-_.~")
_LIST_SPLIT = re.compile(r"[,\s]+")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}
# CPython's own SHA-256 (`_sha2` from 3.12, `_sha256` before; hashlib falls back to it too) rather than OpenSSL's: the
# same digest, but a few hundred bytes of code instead of OpenSSL's EVP dispatch, which a router pays for from cold
# caches on every keyed request (about 2% of its CPU per request; docs/benchmarks-router-keys.md).
try:
    from _sha2 import sha256 as _sha256
except ImportError:
    try:
        from _sha256 import sha256 as _sha256
    except ImportError:
        _sha256 = hashlib.sha256


class InvalidKeySecret(ValueError):
    """A key Secret the operator refuses (its key too short, a field unreadable); `reason` is a CamelCase word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def key_digest(key: str) -> str:
    # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes: hashed as the bytes they were.
    return _sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def key_strength_bytes(key: str) -> int:
    """The random bytes a key can carry, from its alphabet: 4 bits a character in hex, 6 in base64 (base64url)."""
    if key and set(key) <= _HEX:
        return len(key) // 2
    return len(key.rstrip("=")) * 6 // 8


@dataclass(frozen=True, slots=True)  # slots: a grant read on every keyed request is one object, not two
class KeyGrant:
    """What one key may do. Its digest, never the key, is what leaves the operator."""
    digest: str
    adapters: frozenset[str] = frozenset()
    base_model: bool = False
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def may_call(self, model: str, base_model: str) -> bool:
        return self.base_model if model == base_model else model in self.adapters

    def to_json(self) -> dict:
        out: dict = {"digest": self.digest, "adapters": sorted(self.adapters), "baseModel": self.base_model}
        if self.requests_per_minute is not None:
            out["requestsPerMinute"] = self.requests_per_minute
        if self.tokens_per_minute is not None:
            out["tokensPerMinute"] = self.tokens_per_minute
        return out


@dataclass(frozen=True)
class KeyTable:
    """The keys a pool's routers and engines accept. `required` False: no key is asked for (the pool is open)."""
    required: bool = False
    grants: Mapping[str, KeyGrant] = field(default_factory=dict)  # digest -> grant

    def to_json(self) -> dict:
        return {"required": self.required, "keys": [self.grants[d].to_json() for d in sorted(self.grants)]}

    def fingerprint(self) -> str:
        """Equal tables, equal fingerprints: the operator pushes a table to an engine only when it differs."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def authorize(self, authorizations: Sequence[str]) -> KeyGrant | None:
        """The grant of the request's key, from its `Authorization` header values (None when the pool asks for
        none); 401 without a known key. The answer is the same for a missing, malformed, unknown or revoked key;
        a repeated header is refused (proxies disagree on which copy counts)."""
        if not self.required:
            return None
        if len(authorizations) > 1:
            raise Unauthorized("send one 'Authorization' header, not several", param=None, code="invalid_api_key",
                               headers=_UNAUTHORIZED_HEADERS)
        authorization = authorizations[0] if authorizations else None
        scheme, _, key = (authorization or "")[:MAX_HEADER_CHARS + 1].partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key or len(authorization or "") > MAX_HEADER_CHARS:
            raise Unauthorized("this pool requires an API key: send 'Authorization: Bearer <key>'",
                               param=None, code="invalid_api_key", headers=_UNAUTHORIZED_HEADERS)
        digest = key_digest(key)
        grant = self.grants.get(digest)
        if grant is None or not hmac.compare_digest(grant.digest, digest):
            raise Unauthorized("the API key is not valid for this pool", param=None, code="invalid_api_key",
                               headers=_UNAUTHORIZED_HEADERS)
        return grant


OPEN = KeyTable()


def check_model(grant: KeyGrant | None, model: str, base_model: str) -> None:
    """403 when the key may not call `model` (nothing to check without a key: the pool is open); the message is the
    same whether or not `model` exists."""
    if grant is not None and not grant.may_call(model, base_model):
        raise PermissionDenied(f"this API key may not call model {model!r}", param="model",
                               code="model_not_permitted")


def visible_models(grant: KeyGrant | None, names: Iterable[str], base_model: str) -> list[str]:
    """What `/v1/models` lists for a key: everything when the pool is open (grant None)."""
    return [name for name in names if grant is None or grant.may_call(name, base_model)]


def _positive_int(data: Mapping[str, str], name: str) -> int | None:
    text = (data.get(name) or "").strip()
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) <= 10**12:
        raise InvalidKeySecret("InvalidRateLimit", f"{name} must be a whole number from 1 to 10^12, got {text[:40]!r}")
    return int(text)


def grant_from_secret(data: Mapping[str, str]) -> KeyGrant:
    """A key Secret's decoded data -> its grant; InvalidKeySecret names what is wrong without quoting the key."""
    key = data.get("key")
    if not key or not key.strip():
        raise InvalidKeySecret("MissingKey", "the Secret has no 'key' entry")
    key = key.strip()
    if len(key) > MAX_KEY_CHARS or not set(key) <= _TOKEN_CHARS:
        raise InvalidKeySecret("MalformedKey", f"'key' must be at most {MAX_KEY_CHARS} characters of hex or base64 "
                                               "(letters, digits, + / = - _ . ~)")
    if key_strength_bytes(key) < MIN_KEY_BYTES:
        raise InvalidKeySecret("WeakKey", f"'key' must carry at least {MIN_KEY_BYTES} random bytes (64 hex or 43 "
                                          f"base64 characters: openssl rand -hex 32), got {len(key)} characters")
    adapters = frozenset(a for a in _LIST_SPLIT.split(data.get("adapters") or "") if a)
    if len(adapters) > MAX_GRANTED:
        raise InvalidKeySecret("TooManyAdapters", f"'adapters' names {len(adapters)}, over {MAX_GRANTED}")
    base = (data.get("baseModel") or "false").strip().lower()
    if base not in ("true", "false"):
        raise InvalidKeySecret("InvalidBaseModel", f"'baseModel' must be true or false, got {base[:40]!r}")
    return KeyGrant(key_digest(key), adapters, base == "true", _positive_int(data, "requestsPerMinute"),
                    _positive_int(data, "tokensPerMinute"))


def build_table(required: bool, grants: Iterable[KeyGrant]) -> KeyTable:
    """Two Secrets with one key: the grant is the union of theirs (the tighter limit holds)."""
    merged: dict[str, KeyGrant] = {}
    for grant in grants:
        old = merged.get(grant.digest)
        if old is not None:
            grant = KeyGrant(grant.digest, old.adapters | grant.adapters, old.base_model or grant.base_model,
                             _tighter(old.requests_per_minute, grant.requests_per_minute),
                             _tighter(old.tokens_per_minute, grant.tokens_per_minute))
        merged[grant.digest] = grant
    return KeyTable(required, merged)


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def parse_table(raw: object) -> KeyTable:
    """The table's JSON (placement's `apiKeys`, the engine's `PUT /v1/api_keys`) -> KeyTable; ValueError naming
    the field otherwise. Absent (None): the pool is open."""
    if raw is None:
        return OPEN
    if not isinstance(raw, dict) or not isinstance(raw.get("required", False), bool):
        raise ValueError("apiKeys must be an object with a boolean 'required'")
    items = raw.get("keys", [])
    if not isinstance(items, list):
        raise ValueError("apiKeys.keys must be a list")
    grants = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("digest"), str) or not _DIGEST.fullmatch(
                item["digest"]):
            raise ValueError(f"apiKeys.keys[{i}].digest must be a SHA-256 digest in lowercase hex")
        adapters = item.get("adapters", [])
        if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
            raise ValueError(f"apiKeys.keys[{i}].adapters must be a list of names")
        if not isinstance(item.get("baseModel", False), bool):
            raise ValueError(f"apiKeys.keys[{i}].baseModel must be a boolean")
        limits = []
        for name in ("requestsPerMinute", "tokensPerMinute"):
            value = item.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"apiKeys.keys[{i}].{name} must be a positive integer")
            limits.append(value)
        grants.append(KeyGrant(item["digest"], frozenset(adapters), item.get("baseModel", False), *limits))
    return build_table(raw.get("required", False), grants)
