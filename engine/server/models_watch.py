"""Changes of the adapter set, for the operator: `GET /v1/models` carries an `ETag`, and
`GET /v1/models?changed_since=<etag>&wait_s=<s>` answers as soon as the set differs from that tag, or after
`wait_s` seconds with the same list (a long poll).

The tag digests what the operator acts on: each adapter's name, revision, requested source and whether it is
resident (host or device) or only registered. Moves between host and device, which traffic causes all the time,
do not change it. So an adapter unloaded or loaded behind the operator's back, or evicted from the host tier,
reaches the operator within `POLL_S`, while a steady pod costs one open request per `wait_s`.

Bounded: at most `MAX_WATCHES` waits at once (429 beyond), each re-reading the set every `POLL_S`. Served on the
admin port only (admin_api.py); the serving port's list carries the same tag but does not wait.
"""

from __future__ import annotations

import asyncio
import hashlib

from kubelora.contract.errors import InvalidRequest, TooManyWatches
from kubelora.engine.server.serving import Serving

POLL_S = 0.5  # how often a waiting request re-reads the adapter set
MAX_WAIT_S = 60.0
DEFAULT_WAIT_S = 30.0
MAX_WATCHES = 8
RESIDENT = ("host", "device")


def adapter_set_tag(serving: Serving) -> str:
    """16 hex digits of a digest of (name, revision, requested source, resident?) over the served adapters."""
    digest = hashlib.sha256()
    for info in serving.adapters.list():
        if info.is_unloading:
            continue
        requested = serving.requested_sources.get((info.name, info.revision))
        source = requested.lora_path if requested is not None else info.path
        digest.update(f"{info.name}\x00{info.revision}\x00{source}\x00{info.tier in RESIDENT}\x01".encode())
    return digest.hexdigest()[:16]


def parse_wait_s(text: str | None) -> float:
    if text is None:
        return DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_WAIT_S:  # also refuses nan and inf
        raise InvalidRequest(f"'wait_s' must be a number in (0, {MAX_WAIT_S:g}], got {text!r}", param="wait_s",
                             code="out_of_range")
    return value


class ModelsWatch:
    """The long poll's state in one server: how many waits are open."""

    def __init__(self) -> None:
        self._num_waiting = 0

    async def wait_for_change(self, get_serving, tag: str, wait_s: float) -> None:
        """Return once the adapter set's tag differs from `tag`, or after `wait_s`."""
        if self._num_waiting >= MAX_WATCHES:
            raise TooManyWatches(MAX_WATCHES)
        self._num_waiting += 1
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            while adapter_set_tag(get_serving()) == tag and loop.time() < deadline:
                await asyncio.sleep(min(POLL_S, max(deadline - loop.time(), 0.0)))
        finally:
            self._num_waiting -= 1
