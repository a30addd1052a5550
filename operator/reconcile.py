"""One pool's level-based reconcile: observe every ready engine pod, place, close the difference, report.

`PoolReconciler.reconcile()` is idempotent and safe to run at any time (the pool's daemon runs it on a
period and on triggers). Memory kept between runs is only an optimisation or a record that is also in
the status: which source revision the operator loaded on which pod, transient-failure backoff, the last
placement (hysteresis) and permanent failures (also in `status.failedRevision` and
`status.failedPoolSpec`: a failure holds for one source revision under one pool spec, see `specs.pool_fingerprint`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from kubelora.operator import names
from kubelora.operator.builders import build_owner_reference, build_placement_configmap
from kubelora.operator.conditions import build_status_patch
from kubelora.operator.engine_client import EngineClient, EngineError
from kubelora.operator.kube import Kube
from kubelora.operator.observe import Observation, observe_pool
from kubelora.operator.placement import Placement, PlacementRequest, place
from kubelora.operator.plan import Action, DesiredAdapter, Load, ObservedAdapter, Unload, is_current, plan_pod
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.specs import AdapterSpec, InvalidSpec, PoolSpec
from kubelora.operator.status import (Failure, Phase, ReplicaState, ReplicaStatus, build_adapter_status,
                                      build_pool_status)
from kubelora.operator.validation import validate_adapter

log = logging.getLogger("kubelora.operator")
STATUS_WRITES_IN_FLIGHT = 8  # adapter status patches per pool at once (hundreds of adapters change together)


@dataclass
class AdapterSet:
    bodies: dict[str, dict]
    desired: dict[str, DesiredAdapter] = field(default_factory=dict)
    requests: list[PlacementRequest] = field(default_factory=list)
    invalid: dict[str, Failure] = field(default_factory=dict)  # static validation: unloaded, not placed
    frozen: dict[str, Failure] = field(default_factory=dict)  # engine refused this revision: left as is
    blocked: dict[str, Failure] = field(default_factory=dict)  # waiting on its source Secret: left as is

    def left_alone(self) -> dict[str, Failure]:
        """Adapters no call touches this run: what the pods hold of them stays."""
        return {**self.frozen, **self.blocked}


@dataclass
class Retry:
    num_failures: int
    retry_at: float
    message: str


class PoolReconciler:
    def __init__(self, kube: Kube, session: aiohttp.ClientSession, settings: OperatorSettings,
                 namespace: str, name: str) -> None:
        self._kube, self._session, self._settings = kube, session, settings
        self.namespace, self.name = namespace, name
        self._served: dict[tuple[str, str], str] = {}  # (pod, adapter) -> source revision loaded there
        self._retries: dict[tuple[str, str], Retry] = {}
        # adapter -> (source revision, pool fingerprint, failure): the engine refused that revision under that
        # pool spec; a new revision or a changed pool (say a raised maxLoraRank) tries once more.
        self._permanent: dict[str, tuple[str, str, Failure]] = {}
        self._pool_fingerprint = ""
        self._stale_pods: set[str] = set()  # pods made from an older pool spec (being rolled out)
        self._previous: dict[str, tuple[str, ...]] | None = None
        self._published: tuple[int, str] | None = None  # (revision, payload without revision)

    async def reconcile(self) -> None:
        body = await self._kube.get_custom(names.POOL_PLURAL, self.namespace, self.name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            pool = PoolSpec.from_body(body)
        except InvalidSpec as exc:
            await self._write_pool_status(body, None, Observation([]), None, 0, 0, Failure(exc.reason, str(exc)))
            return
        self._pool_fingerprint = pool.fingerprint
        bodies = [a for a in await self._kube.list_custom(names.ADAPTER_PLURAL, self.namespace)
                  if (a.get("spec") or {}).get("pool") == self.name]
        adapters = self._classify(bodies, pool, await self._source_tokens(bodies))
        token = await self._admin_token(pool)
        client = EngineClient(self._session, token, self._settings.engine_timeout_s)
        observation = await self._observe(client)
        await self._load_previous_placement()
        placement = place(adapters.requests, observation.urls, pool.engine.max_cpu_loras, self._previous)
        self._previous = placement.pods_by_adapter
        await self._execute(self._plan(adapters, placement, observation), client, observation, adapters)
        self._freeze_new_failures(adapters)
        revision = await self._publish(pool, body, observation, placement, adapters)
        await self._write_adapter_statuses(adapters, placement, observation)
        await self._write_pool_status(body, pool, observation, placement, revision, len(bodies), None)

    # ---- inputs ----

    async def _source_tokens(self, bodies: list[dict]) -> dict[str, str | None]:
        """adapter -> the token its spec.source.authSecretRef names (None: Secret or key missing)."""
        refs = {}
        for body in bodies:
            ref = ((body.get("spec") or {}).get("source") or {}).get("authSecretRef")
            if ref and ref.get("name") and not body["metadata"].get("deletionTimestamp"):
                refs[body["metadata"]["name"]] = (ref["name"], ref.get("key", "token"))
        values = await asyncio.gather(*(self._kube.read_secret_key(self.namespace, name, key)
                                        for name, key in refs.values()))
        return dict(zip(refs, values))

    def _classify(self, bodies: list[dict], pool: PoolSpec, tokens: dict[str, str | None]) -> AdapterSet:
        adapters = AdapterSet(bodies={b["metadata"]["name"]: b for b in bodies})
        self._permanent = {k: v for k, v in self._permanent.items() if k in adapters.bodies}
        for name, body in adapters.bodies.items():
            if body["metadata"].get("deletionTimestamp"):
                continue
            try:
                spec = AdapterSpec.from_body(body)
                validate_adapter(spec, pool)
            except InvalidSpec as exc:
                adapters.invalid[name] = Failure(exc.reason, str(exc))
                continue
            secret = spec.source.auth_secret
            if secret is not None and not tokens.get(name):
                # Not final: checked again every run, so creating the Secret is enough.
                adapters.blocked[name] = Failure("SecretNotFound", f"spec.source.authSecretRef: Secret "
                                                 f"{self.namespace}/{secret.name} has no key {secret.key!r}")
                continue
            revision = spec.source.revision
            self._remember_served(name, body)
            failure = self._permanent_failure(name, body, revision)
            if failure is not None:
                adapters.frozen[name] = failure
                continue
            adapters.desired[name] = DesiredAdapter(name, spec.source.lora_path, spec.source.sha256, revision,
                                                    auth_token=tokens.get(name))
            adapters.requests.append(PlacementRequest(name, spec.replicas))
        return adapters

    def _remember_served(self, name: str, body: dict) -> None:
        """After an operator restart, the status tells which revision each placed pod was given."""
        for entry in (body.get("status") or {}).get("replicas") or []:
            if entry.get("revision") and entry.get("state") == ReplicaState.LOADED.value:
                self._served.setdefault((entry["pod"], name), entry["revision"])

    def _permanent_failure(self, name: str, body: dict, revision: str) -> Failure | None:
        remembered = self._permanent.get(name)
        if remembered is not None and remembered[:2] == (revision, self._pool_fingerprint):
            return remembered[2]
        status = body.get("status") or {}
        # After an operator restart the status tells; a status written before failedPoolSpec existed counts
        # as the current pool's.
        failed_pool = status.get("failedPoolSpec", self._pool_fingerprint)
        if status.get("failedRevision") == revision and failed_pool == self._pool_fingerprint and remembered is None:
            ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
            failure = Failure(ready.get("reason", "LoadFailed"), ready.get("message", "the engine refused it"))
            self._permanent[name] = (revision, self._pool_fingerprint, failure)
            return failure
        self._permanent.pop(name, None)
        return None

    def _freeze_new_failures(self, adapters: AdapterSet) -> None:
        """Adapters the engine refused during this run report Failed now, not one run later."""
        for name, want in list(adapters.desired.items()):
            remembered = self._permanent.get(name)
            if remembered is not None and remembered[:2] == (want.source_revision, self._pool_fingerprint):
                adapters.frozen[name] = remembered[2]
                del adapters.desired[name]

    async def _admin_token(self, pool: PoolSpec) -> str | None:
        if pool.admin_token is None:
            return None
        token = await self._kube.read_secret_key(self.namespace, pool.admin_token.name, pool.admin_token.key)
        if token is None:
            log.warning("pool %s/%s: admin token Secret %s (key %s) not found", self.namespace, self.name,
                        pool.admin_token.name, pool.admin_token.key)
        return token

    async def _observe(self, client: EngineClient) -> Observation:
        observation = await observe_pool(self._kube, client, self.namespace, self.name)
        known = {p["metadata"]["name"] for p in observation.pods}
        self._stale_pods = {p["metadata"]["name"] for p in observation.pods
                            if (p["metadata"].get("annotations") or {}).get(names.ANNOTATION_POOL_SPEC)
                            != self._pool_fingerprint}
        self._served = {k: v for k, v in self._served.items() if k[0] in known}
        self._retries = {k: v for k, v in self._retries.items() if k[0] in known}
        return observation

    async def _load_previous_placement(self) -> None:
        """Hysteresis across operator restarts: the published holders are the previous placement."""
        if self._previous is not None:
            return
        configmap = await self._kube.get("ConfigMap", self.namespace, names.placement_configmap_name(self.name))
        try:
            payload = json.loads(((configmap or {}).get("data") or {}).get("placement.json", "{}"))
        except ValueError:
            payload = {}
        self._previous = {a: tuple(p) for a, p in (payload.get("adapters") or {}).items()}
        revision = int(payload.get("revision") or 0)
        self._published = (revision, "")

    # ---- actions ----

    def _plan(self, adapters: AdapterSet, placement: Placement, observation: Observation) -> list[Action]:
        actions: list[Action] = []
        for pod, observed in observation.adapters.items():
            served = {a: r for (p, a), r in self._served.items() if p == pod}
            actions += plan_pod(pod, adapters.desired, set(placement.adapters_on(pod)), observed, served,
                                frozen=adapters.left_alone())
        now = time.monotonic()
        return [a for a in actions if self._retries.get((a.pod, _name(a)), Retry(0, 0.0, "")).retry_at <= now]

    async def _execute(self, actions: list[Action], client: EngineClient, observation: Observation,
                       adapters: AdapterSet) -> None:
        limit = asyncio.Semaphore(self._settings.max_concurrent_calls)

        async def run(action: Action) -> None:
            async with limit:
                await self._run_action(action, client, observation, adapters)

        await asyncio.gather(*(run(a) for a in actions))

    async def _run_action(self, action: Action, client: EngineClient, observation: Observation,
                          adapters: AdapterSet) -> None:
        url, key = observation.urls[action.pod], (action.pod, _name(action))
        involved = adapters.bodies.get(_name(action))
        try:
            if isinstance(action, Unload):
                await client.unload(url, action.adapter)
                observation.adapters[action.pod].pop(action.adapter, None)
                self._served.pop(key, None)
                await self._event(involved, "Normal", "Unloaded", f"unloaded from pod {action.pod}")
                return
            result = await client.load(url, action.adapter, is_preload=action.is_preload,
                                       is_inplace=action.is_inplace)
        except EngineError as exc:
            await self._record_failure(action, key, exc, involved)
            return
        card = {**result.card, "id": action.adapter.name, "source": action.adapter.lora_path}
        observation.adapters[action.pod][action.adapter.name] = ObservedAdapter.from_card(card)
        self._served[key] = action.adapter.source_revision
        self._retries.pop(key, None)
        if action.is_preload or action.is_inplace:
            verb = "Reloaded" if action.is_inplace else "Loaded"
            await self._event(involved, "Normal", verb, f"revision {action.adapter.source_revision} (content "
                              f"{card.get('revision')}) on pod {action.pod}, preload={action.is_preload}")

    async def _record_failure(self, action: Action, key: tuple[str, str], exc: EngineError,
                              involved: dict | None) -> None:
        # A refusal is the adapter's own fault only on a pod made from the current pool spec; an older pod is
        # being replaced (say maxLoraRank was just raised): back off and try again, on the new pod.
        if isinstance(action, Load) and exc.is_permanent and action.pod not in self._stale_pods:
            failure = Failure(exc.reason, f"pod {action.pod}: {exc}")
            self._permanent[action.adapter.name] = (action.adapter.source_revision, self._pool_fingerprint, failure)
            await self._event(involved, "Warning", "LoadFailed", f"{failure.reason}: {failure.message}")
            return
        previous = self._retries.get(key)
        num_failures = 1 if previous is None else previous.num_failures + 1
        delay = self._settings.backoff_s(num_failures)
        self._retries[key] = Retry(num_failures, time.monotonic() + delay, str(exc))
        verb = "UnloadFailed" if isinstance(action, Unload) else "LoadFailed"
        if num_failures == 1:
            await self._event(involved, "Warning", verb, f"pod {action.pod}: {exc}; retrying with backoff")

    async def _event(self, involved: dict | None, event_type: str, reason: str, message: str) -> None:
        if involved is not None:
            await self._kube.create_event(involved, event_type, reason, message)

    # ---- outputs ----

    def _holders(self, name: str, pods: tuple[str, ...] | list[str], observation: Observation,
                 want: DesiredAdapter | None) -> list[str]:
        holders = []
        for pod in pods:
            have = observation.adapters.get(pod, {}).get(name)
            if have is None or not have.is_resident:
                continue
            if want is None or is_current(have, want, self._served.get((pod, name))):
                holders.append(pod)
        return holders

    async def _publish(self, pool: PoolSpec, body: dict, observation: Observation, placement: Placement,
                       adapters: AdapterSet) -> int:
        held = {name: self._holders(name, placement.pods_of(name), observation, want)
                for name, want in adapters.desired.items()}
        held.update({name: self._holders(name, sorted(observation.adapters), observation, None)
                     for name in adapters.left_alone()})
        replicas = [{"pod": pod, "url": url, "ready": pod in observation.urls}
                    for pod, url in observation.all_urls.items()]
        payload = {"pool": self.name, "baseModel": pool.served_name, "replicas": sorted(replicas,
                   key=lambda r: r["pod"]), "adapters": held}
        fingerprint = json.dumps(payload, sort_keys=True)
        revision, last = self._published or (0, "")
        if fingerprint == last:
            return revision
        revision += 1
        configmap = build_placement_configmap(pool, build_owner_reference(body), {**payload, "revision": revision})
        await self._kube.apply(configmap)
        self._published = (revision, fingerprint)
        return revision

    async def _write_adapter_statuses(self, adapters: AdapterSet, placement: Placement,
                                      observation: Observation) -> None:
        limit = asyncio.Semaphore(STATUS_WRITES_IN_FLIGHT)

        async def write(name: str, body: dict) -> None:
            async with limit:
                await self._patch_adapter_status(body, self._adapter_status(name, body, adapters, placement,
                                                                            observation))

        await asyncio.gather(*(write(name, body) for name, body in adapters.bodies.items()
                               if not body["metadata"].get("deletionTimestamp")))

    def _adapter_status(self, name: str, body: dict, adapters: AdapterSet, placement: Placement,
                        observation: Observation) -> dict:
        generation = int(body["metadata"].get("generation") or 0)
        try:
            revision = AdapterSpec.from_body(body).source.revision
        except InvalidSpec:
            revision = ""
        failure = adapters.invalid.get(name) or adapters.left_alone().get(name)
        if failure is not None:
            replicas = [self._replica_status(name, pod, observation, None)
                        for pod in self._holders(name, sorted(observation.adapters), observation, None)]
            return build_adapter_status(generation=generation, revision=revision, wanted=0, replicas=replicas,
                                        failure=failure,
                                        failed_revision=revision if name in adapters.frozen else None,
                                        failed_pool_spec=self._pool_fingerprint)
        want = adapters.desired[name]
        replicas = [self._replica_status(name, pod, observation, want) for pod in placement.pods_of(name)]
        pending = None
        if not observation.urls:
            pending = Failure("NoReadyReplicas", "no engine replica of the pool is ready")
        return build_adapter_status(generation=generation, revision=revision,
                                    wanted=placement.wanted_by_adapter.get(name, 0), replicas=replicas,
                                    pending=pending)

    def _replica_status(self, name: str, pod: str, observation: Observation,
                        want: DesiredAdapter | None) -> ReplicaStatus:
        have = observation.adapters.get(pod, {}).get(name)
        retry = self._retries.get((pod, name))
        error = retry.message if retry is not None else (have.last_error if have is not None else None)
        if have is not None and have.is_resident and (want is None or is_current(
                have, want, self._served.get((pod, name)))):
            served = self._served.get((pod, name)) or (want.source_revision if want is not None else None)
            return ReplicaStatus(pod, ReplicaState.LOADED, revision=served,
                                 content_revision=have.content_revision, residency=have.residency,
                                 loaded_at=have.loaded_at, last_error=error)
        state = ReplicaState.LOADING if retry is None else ReplicaState.PENDING
        return ReplicaStatus(pod, state, last_error=error)

    async def _patch_adapter_status(self, body: dict, new: dict) -> None:
        old = body.get("status") or {}
        status = build_status_patch(old, new)
        if status is None:
            return
        meta = body["metadata"]
        await self._kube.patch_status(names.ADAPTER_PLURAL, meta["namespace"], meta["name"], status)
        if old.get("phase") != status["phase"]:
            event_type = "Warning" if status["phase"] in (Phase.FAILED.value, Phase.DEGRADED.value) else "Normal"
            ready = next(c for c in status["conditions"] if c["type"] == "Ready")
            await self._event(body, event_type, status["phase"], f"{ready['reason']}: {ready['message']}")

    async def _write_pool_status(self, body: dict, pool: PoolSpec | None, observation: Observation,
                                 placement: Placement | None, revision: int, num_adapters: int,
                                 invalid: Failure | None) -> None:
        capacity = pool.engine.max_cpu_loras if pool is not None else 0
        pods = []
        for pod in sorted(observation.pods, key=lambda p: p["metadata"]["name"]):
            name = pod["metadata"]["name"]
            placed = placement.adapters_on(name) if placement is not None else []
            entry = {"name": name, "ip": (pod.get("status") or {}).get("podIP") or "",
                     "ready": name in observation.urls,
                     "adapters": self._placed_and_loaded(name, placed, observation),
                     "numRegistered": len(observation.adapters.get(name, {})),
                     "freeSlots": max(capacity - len(placed), 0)}
            pods.append(entry)
        spec_replicas = int((body.get("spec") or {}).get("replicas", 1))
        status = build_pool_status(
            generation=int(body["metadata"].get("generation") or 0), spec_replicas=spec_replicas,
            num_pods=len(observation.pods), pods=pods,
            selector=names.selector_string(names.engine_selector(self.name)),
            num_adapters=num_adapters, placement_revision=revision, invalid=invalid)
        patch = build_status_patch(body.get("status"), status)
        if patch is not None:
            await self._kube.patch_status(names.POOL_PLURAL, self.namespace, self.name, patch)

    def _placed_and_loaded(self, pod: str, placed: list[str], observation: Observation) -> list[str]:
        held = observation.adapters.get(pod, {})
        return [a for a in placed if a in held and held[a].is_resident]


def _name(action: Action) -> str:
    return action.adapter if isinstance(action, Unload) else action.adapter.name
