"""Every write the operator makes for a pool, in one place: the objects it owns (`apply_pool`, `apply_placement`,
`read_admin_token`) and the statuses of the pool and its adapters (`write_status`, with its phase events).

The kopf handlers and the reconcile decide what to write; these functions write it. All of them are idempotent:
server-side apply of an unchanged object writes nothing, deleting a missing one is a no-op, and a status that
says nothing new is not patched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from kubelora.operator import names
from kubelora.operator.builders import (build_admin_token_secret, build_owner_reference, build_placement_configmap,
                                        build_pool_manifests, build_router_manifest_keys)
from kubelora.operator.conditions import build_status_patch
from kubelora.operator.decide import Event
from kubelora.operator.kube import Kube
from kubelora.operator.report import phase_event
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.specs import PoolSpec

log = logging.getLogger("kubelora.operator")


@dataclass(frozen=True)
class AdminToken:
    value: str | None  # None: the pool has no admin token, or its Secret (or key) is missing
    is_new: bool = False  # its Secret was missing and was created now: the engines must roll onto it
    # digest -> token: the earlier tokens its generated Secret kept for the pods still running with them
    previous: Mapping[str, str] = field(default_factory=dict)


async def read_admin_token(kube: Kube, body: dict, pool: PoolSpec, known: Mapping[str, str] | None = None
                           ) -> AdminToken:
    """The admin token the pool's engines are to answer to. A missing operator-managed Secret is created first,
    with a random token (before the Deployment, whose pods read it from that Secret), and with the tokens in
    `known` (digest -> token: those pods of the pool still run with, tokens.py), so that an operator restarted
    during the rollout still calls the old pods with theirs. body: the LoRAPool."""
    ref = pool.admin_token
    if ref is None:
        return AdminToken(None)
    data = await kube.read_secret_data(pool.namespace, ref.name)
    is_new = False
    if data is None and pool.is_admin_token_managed:
        # False when someone created it meanwhile: theirs is read below and kept
        await kube.create(build_admin_token_secret(pool, build_owner_reference(body), previous=known))
        data = await kube.read_secret_data(pool.namespace, ref.name)
        is_new = data is not None and data.get(ref.key) is not None
        log.info("pool %s/%s: created the admin token Secret %s", pool.namespace, pool.name, ref.name)
    token = None if data is None else data.get(ref.key)
    if token is None:
        log.warning("pool %s/%s: admin token Secret %s (key %s) not found", pool.namespace, pool.name, ref.name,
                    ref.key)
        return AdminToken(None)
    previous = {}
    if pool.is_admin_token_managed:
        previous = {key.removeprefix(names.PREVIOUS_TOKEN_PREFIX): value for key, value in data.items()
                    if key.startswith(names.PREVIOUS_TOKEN_PREFIX)}
    return AdminToken(token, is_new, previous)


async def apply_pool(kube: Kube, body: dict, pool: PoolSpec, settings: OperatorSettings, admin_token: str | None,
                     placement: dict | None = None) -> None:
    """Make what the pool owns match its spec: apply the engine Deployment (carrying `admin_token`'s digest, so a
    new token rolls its pods), the Services, the NetworkPolicy and the router when enabled, and delete the last
    two when not. placement: the published payload, re-applied as it is (None: leave the ConfigMap alone)."""
    network, owner = settings.network_policy, build_owner_reference(body)
    for manifest in build_pool_manifests(pool, owner, settings.images, network, admin_token):
        await kube.apply(manifest)
    if not network.is_enabled:
        await kube.delete("NetworkPolicy", pool.namespace, names.network_policy_name(pool.name))
    if not pool.router.is_enabled:
        for kind, name in build_router_manifest_keys(pool):
            await kube.delete(kind, pool.namespace, name)
    if placement is not None:
        await apply_placement(kube, body, pool, placement)


async def apply_placement(kube: Kube, body: dict, pool: PoolSpec, placement: dict) -> None:
    await kube.apply(build_placement_configmap(pool, build_owner_reference(body), placement))


async def write_status(kube: Kube, plural: str, body: dict, new: dict) -> None:
    """Patch the object's status to `new` unless it says nothing the stored one does not (build_status_patch).
    A status with a phase (an adapter's) also gets one event per phase change (report.phase_event)."""
    old = body.get("status") or {}
    patch = build_status_patch(old, new)
    if patch is None:
        return
    meta = body["metadata"]
    await kube.patch_status(plural, meta["namespace"], meta["name"], patch)
    event = phase_event(meta["name"], old, patch) if "phase" in patch else None
    if event is not None:
        await post_event(kube, body, event)


async def post_event(kube: Kube, involved: dict, event: Event) -> None:
    await kube.create_event(involved, "Warning" if event.is_warning else "Normal", event.reason, event.message)
