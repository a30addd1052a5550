"""Desired vs observed, per engine pod: the load and unload calls that close the difference. Pure.

Level-based: the input is what a pod reports (`GET /v1/models`) now, so a restarted pod, a new pod, an
engine that lost its adapters or a hand-made load all produce the same kind of plan.
- placed adapters: loaded with `preload: true` (staged in memory), at the current source revision;
- every other adapter of the pool: registered with `preload: false`, so any replica can serve it on demand;
- anything else on the pod (deleted adapters, manual loads): unloaded;
- `frozen` adapters (failed permanently for their current revision) are left exactly as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kubelora.contract.load import S3Access


RESIDENT = ("host", "device")


@dataclass(frozen=True)
class ObservedAdapter:
    """One adapter card of `GET /v1/models`."""
    name: str
    source: str | None
    sha256: str | None  # the digest the engine checked the load against (None: none given)
    content_revision: str | None
    residency: str
    loaded_at: float | None = None
    last_error: str | None = None
    # "sha256:<hex>" of the full lora_path: the engine redacts `source` (query strings, credentials) for callers
    # without its admin token, and shows this to every caller.
    source_digest: str | None = None
    rank: int | None = None  # what the files say (max over modules); None: not reported
    targets: tuple[str, ...] | None = None  # modules the files adapt
    num_bytes: int | None = None  # device adapter pool bytes at its own ranks
    tokens_served: int | None = None  # prompt + generated tokens of its finished requests since the engine started

    @classmethod
    def from_card(cls, card: dict) -> ObservedAdapter:
        targets = card.get("targets")
        return cls(name=card["id"], source=card.get("source"), sha256=card.get("sha256"),
                   content_revision=card.get("revision"),
                   residency=card.get("residency", "known"), loaded_at=card.get("created"),
                   last_error=card.get("last_error"), source_digest=card.get("source_digest"),
                   rank=card.get("rank") if isinstance(card.get("rank"), int) else None,
                   targets=tuple(targets) if isinstance(targets, list) else None,
                   num_bytes=card.get("bytes") if isinstance(card.get("bytes"), int) else None,
                   tokens_served=card.get("tokens_served") if isinstance(card.get("tokens_served"), int) else None)

    def has_source(self, lora_path: str) -> bool:
        digest = "sha256:" + hashlib.sha256(lora_path.encode()).hexdigest()
        return self.source == lora_path or (self.source_digest is not None and self.source_digest == digest)

    @property
    def is_resident(self) -> bool:
        return self.residency in RESIDENT


@dataclass(frozen=True)
class DesiredAdapter:
    name: str
    lora_path: str
    sha256: str | None
    source_revision: str
    auth_token: str | None = field(default=None, repr=False, compare=False)  # from spec.source.authSecretRef
    s3: S3Access | None = field(default=None, repr=False, compare=False)  # an s3 source's endpoint and keys
    declared_rank: int | None = field(default=None, compare=False)  # spec.rank, checked against the files
    declared_targets: tuple[str, ...] = field(default=(), compare=False)  # spec.targets, likewise
    generation: int = field(default=0, compare=False)  # the LoRAAdapter's metadata.generation


@dataclass(frozen=True)
class Load:
    pod: str
    adapter: DesiredAdapter
    is_preload: bool
    is_inplace: bool
    # The pod serves the current revision but its host tier let the placed copy go (evicted by on-demand loads):
    # a preload to make it resident again, which decide.py paces (REPRELOAD_S) so it never fights the tier's LRU.
    is_residency_repair: bool = False


@dataclass(frozen=True)
class Unload:
    pod: str
    adapter: str


Action = Load | Unload


def is_current(observed: ObservedAdapter | None, desired: DesiredAdapter, served_revision: str | None) -> bool:
    """The pod has the desired source and sha256 (the engine's card echoes both, so this holds across operator
    restarts); `served_revision` (what the operator last loaded there, if known) must match too."""
    if observed is None or not observed.has_source(desired.lora_path) or observed.sha256 != desired.sha256:
        return False
    return served_revision is None or served_revision == desired.source_revision


def plan_pod(pod: str, desired: Mapping[str, DesiredAdapter], placed: Collection[str],
             observed: Mapping[str, ObservedAdapter], served_revisions: Mapping[str, str],
             frozen: Collection[str] = ()) -> list[Action]:
    actions: list[Action] = []
    for name, want in sorted(desired.items()):
        if name in frozen:
            continue
        have = observed.get(name)
        current = is_current(have, want, served_revisions.get(name))
        if name in placed:
            if not current or not have.is_resident:  # type: ignore[union-attr]
                actions.append(Load(pod, want, is_preload=True, is_inplace=have is not None,
                                    is_residency_repair=current))
        elif not current:
            actions.append(Load(pod, want, is_preload=False, is_inplace=have is not None))
    for name in sorted(observed):
        if name not in desired and name not in frozen:
            actions.append(Unload(pod, name))
    return actions
