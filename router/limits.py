"""Per-key request and token rates, counted by this router replica alone (N replicas admit up to N times a key's
limits; docs/router.md). Pure but for the clock it is given.

Each limit is a bucket that refills at `limit / 60` a second up to `limit`. A request is admitted while the
request bucket holds one and the token bucket is not in debt; it then takes one request and its token estimate
(which may put the token bucket in debt: a large request is admitted once and the key waits it out, instead of a
request larger than the limit never passing). The estimate is made at admission, as OpenAI's own limits do: the
body's bytes / 4 for the prompt, plus the completion's `max_tokens` (or `max_completion_tokens`), or
`DEFAULT_COMPLETION_TOKENS` when the request sets neither.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kubelora.contract.errors import RateLimited
from kubelora.contract.keys import KeyGrant

DEFAULT_COMPLETION_TOKENS = 256
_MAX_CHARGE = 10**9


def estimate_tokens(body_bytes: int, payload: dict) -> int:
    completion = payload.get("max_completion_tokens", payload.get("max_tokens"))
    if not isinstance(completion, int) or isinstance(completion, bool) or completion < 0:
        completion = DEFAULT_COMPLETION_TOKENS
    return min(math.ceil(body_bytes / 4) + completion, _MAX_CHARGE)


@dataclass
class _Bucket:
    level: float
    at: float

    def refill(self, limit: int, now: float) -> None:
        self.level = min(float(limit), self.level + (now - self.at) * limit / 60.0)
        self.at = now


class KeyLimits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def admit(self, grant: KeyGrant, tokens: int) -> None:
        """Take one request and `tokens` from the key's buckets, or raise RateLimited with the wait until it
        would be admitted."""
        rpm, tpm, now = grant.requests_per_minute, grant.tokens_per_minute, self._clock()
        requests = self._bucket(self._requests, grant.digest, rpm, now)
        budget = self._bucket(self._tokens, grant.digest, tpm, now)
        if requests is not None and requests.level < 1:
            raise RateLimited(f"this API key is over its {rpm} requests per minute on this router",
                              (1 - requests.level) * 60.0 / rpm)
        if budget is not None and budget.level < 0:
            raise RateLimited(f"this API key is over its {tpm} tokens per minute on this router",
                              -budget.level * 60.0 / tpm)
        if requests is not None:
            requests.level -= 1
        if budget is not None:
            budget.level -= tokens

    @staticmethod
    def _bucket(buckets: dict[str, _Bucket], digest: str, limit: int | None, now: float) -> _Bucket | None:
        if limit is None:
            buckets.pop(digest, None)
            return None
        bucket = buckets.get(digest)
        if bucket is None:
            bucket = buckets[digest] = _Bucket(float(limit), now)
        else:
            bucket.refill(limit, now)
        return bucket
