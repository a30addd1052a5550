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


@dataclass(slots=True)
class _KeyState:
    """One key's buckets: their levels (None where the key has no such limit) when last refilled, `at`."""
    requests: float | None
    tokens: float | None
    at: float


class KeyLimits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}

    def admit_request(self, grant: KeyGrant, body_bytes: int, payload: dict) -> None:
        """Take one request and its token estimate from the key's buckets, or raise RateLimited with the wait
        until it would be admitted. A key without limits returns at once and tokens are estimated only under a
        token limit: the router runs this on every keyed request, and each call and lookup here costs it CPU
        (docs/benchmarks-router-keys.md), hence one lookup and no helper calls but the token estimate."""
        rpm, tpm = grant.requests_per_minute, grant.tokens_per_minute
        if rpm is None and tpm is None:
            return
        now = self._clock()
        state = self._keys.get(grant.digest)
        if state is None:
            state = self._keys[grant.digest] = _KeyState(rpm, tpm, now)
        else:  # refill; a limit just set starts full, a limit removed drops its bucket
            elapsed_s, state.at = now - state.at, now
            if rpm is None or state.requests is None:
                state.requests = rpm
            else:
                state.requests = min(rpm, state.requests + elapsed_s * rpm / 60.0)
            if tpm is None or state.tokens is None:
                state.tokens = tpm
            else:
                state.tokens = min(tpm, state.tokens + elapsed_s * tpm / 60.0)
        if state.requests is not None and state.requests < 1:
            raise RateLimited(f"this API key is over its {rpm} requests per minute on this router",
                              (1 - state.requests) * 60.0 / rpm)
        if state.tokens is not None and state.tokens < 0:
            raise RateLimited(f"this API key is over its {tpm} tokens per minute on this router",
                              -state.tokens * 60.0 / tpm)
        if state.requests is not None:
            state.requests -= 1
        if state.tokens is not None:
            state.tokens -= estimate_tokens(body_bytes, payload)
