"""One pool's level-based reconcile, the acting half: fetch -> plan -> execute -> publish -> ask routers -> patch.

`PoolReconciler.reconcile()` is idempotent and safe to run at any time (the pool's daemon runs it on a
period and on triggers). Every decision is pure and lives elsewhere: `decide.plan_pass` (which adapters are
invalid, waiting, refused or desired; placement; the calls that are due), `decide.record_result` (a refusal
that holds, or a retry with backoff), `report.build_publication` (the placement payload) and
`report.report_publication` (status, once the routers said which revision they route on). This class
only reads and calls, writes through writes.py (objects, statuses, events), and keeps the one `ReconcileMemory`
between passes (memory.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import aiohttp

from kubelora.contract.load import S3Access
from kubelora.operator import names
from kubelora.operator.api_keys import (PoolKeys, RefusalMemory, engines_to_push, list_key_secrets, read_pool_keys,
                                       refusal_events)
from kubelora.operator.decide import (CallResult, Change, Event, PassPlan, PoolView, StoredPlacement, adapter_name,
                                     plan_pass, record_result)
from kubelora.operator.engine_client import EngineClient, EngineError
from kubelora.operator.kube import Kube
from kubelora.operator.memory import ReconcileMemory
from kubelora.operator.observe import observe_pool, observe_routers
from kubelora.operator.plan import Action, Unload
from kubelora.operator.report import Publication, Report, build_publication, invalid_pool_status, report_publication
from kubelora.operator.routers import ACK_WAIT_S, BEHIND_ACK_WAIT_S, RouterView
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.specs import InvalidSpec, PoolSpec
from kubelora.operator.status import Failure
from kubelora.operator.tokens import remember_tokens, token_for_pod
from kubelora.operator.writes import apply_placement, apply_pool, post_event, read_admin_token, write_status

log = logging.getLogger("kubelora.operator")
KEY_RETRY_S = 1.0  # the next pass this soon after an engine did not take the API key table
STATUS_WRITES_IN_FLIGHT = 8  # adapter status patches per pool at once (hundreds of adapters change together)
# A pass decides for the changed adapters only (decide.Change) while this few changed: it reads each one's object,
# where a whole pass lists them all; more make a whole pass (a bulk apply or delete).
MAX_CHANGED_ADAPTERS = 64


@dataclass(frozen=True)
class _LastPass:
    """What the last pass decided from and left: a pass for changed adapters starts from it."""
    view: PoolView  # its observation with the pass's successful calls applied (report.held_after)
    plan: PassPlan
    clients: _PodClients
    called: frozenset[str]  # adapters it called an engine for


class PoolReconciler:
    def __init__(self, kube: Kube, session: aiohttp.ClientSession, settings: OperatorSettings,
                 namespace: str, name: str, on_released: Callable[[frozenset[str]], None] | None = None,
                 take_heal_request: Callable[[], bool] | None = None) -> None:
        """on_released: told after each pass which adapters being deleted no observed pod holds any more.
        take_heal_request: True once after an object the pool owns was deleted (handlers.py watches them): the
        next pass re-applies them without waiting for the resync."""
        self._kube, self._session, self._settings = kube, session, settings
        self.namespace, self.name = namespace, name
        self._on_released = on_released
        self._take_heal_request = take_heal_request or (lambda: False)
        self._memory = ReconcileMemory()
        # What the last pass observed, for the pod watchers (watch.py): ready pods that answered, and the admin
        # token each answers to (admin URL -> token).
        self.observed_urls: dict[str, str] = {}
        self.observed_tokens: dict[str, str | None] = {}
        self.admin_token: str | None = None  # the Secret's current value
        self._tokens: dict[str, str] = {}  # digest -> token, for every token some engine pod still runs with
        self._healed_at = time.monotonic()  # on_pool_spec applied them just now (create, update or resume)
        self._is_token_new = False  # the admin token was recreated or rotated: re-apply now (the engines roll)
        self.next_pass_s: float | None = None  # the last pass asks for the next this soon (a router lags)
        # The key Secrets' versions the last pass read (None: the pool requires no keys): the daemon's poll
        # starts a pass when they change (api_keys.watch_key_secrets).
        self.key_versions: frozenset[tuple[str, str]] | None = None
        self._warned_secrets: frozenset[tuple[str, str]] = frozenset()  # (Secret, version) refused, event posted
        self._refusals = RefusalMemory()  # the routers' key refusals told so far (_tell_refusals)
        self._last: _LastPass | None = None
        self._whole_at = -float("inf")  # time.monotonic() the last whole pass ended

    @property
    def whole_pass_due_s(self) -> float:
        """Seconds until a whole pass is due: `resync_s` after the last one ended (passes for changed adapters do
        not count)."""
        return max(self._whole_at + self._settings.resync_s - time.monotonic(), 0.0)

    async def reconcile(self, changed: frozenset[str] | None = None) -> None:
        """One pass. changed: the adapters whose objects changed since the last pass, when nothing else did (None:
        unknown). Then, unless a whole pass is due, it decides for those adapters only, from what the last pass
        left (`decide.Change`): their objects are read again, the pods and what they hold are not. A whole pass
        (every `resync_s`, and on any other trigger) reads everything and decides over the whole pool."""
        body = await self._kube.get_custom(names.POOL_PLURAL, self.namespace, self.name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            pool = PoolSpec.from_body(body)
        except InvalidSpec as exc:
            await self._patch_pool(body, invalid_pool_status(self.name, body, Failure(exc.reason, str(exc))))
            return
        change = self._change(changed, pool)
        # Kept only by a pass that ends (after a failed one, a whole pass), and let go before a whole pass reads
        # everything again (at 2,000 adapters the last view is tens of MB).
        last, self._last = self._last if change is not None else None, None
        try:
            self._last = await self._pass(body, pool, change, last)
        finally:
            if change is None:
                self._whole_at = time.monotonic()

    async def _pass(self, body: dict, pool: PoolSpec, change: Change | None, last: _LastPass | None) -> _LastPass:
        if change is None or last is None:
            view, clients = await self._fetch(body, pool)
        else:
            view, clients = await self._fetch_changed(body, pool, change.adapters, last)
        self.observed_urls = dict(view.observation.urls)
        self.observed_tokens = {url: clients.token(pod) for pod, url in view.observation.urls.items()}
        plan, self._memory = plan_pass(view, self._memory, time.time(), change)
        # before a placement routes to the pods; the tables whole passes read and pushed stand meanwhile
        is_keys_behind = await self._push_keys(view, clients) if change is None else False
        results = await self._execute(plan, clients, view)
        publication = build_publication(view, plan, results, self._memory)
        await self._publish(pool, body, publication.placement)
        routers = await self._ask_routers(pool, publication)
        report = report_publication(view, plan, publication, routers)
        self._memory = report.memory  # only once the placement it records is written
        self.next_pass_s = min(report.next_pass_s or KEY_RETRY_S, KEY_RETRY_S) if is_keys_behind else \
            report.next_pass_s
        if self._on_released is not None and report.released:
            self._on_released(report.released)
        await self._patch_adapters(view.bodies, report)
        await self._patch_pool(body, report.pool_status)
        await self._tell_refusals(view, routers)
        is_heal_due = self._take_heal_request() or self._is_token_new
        if is_heal_due or time.monotonic() - self._healed_at >= self._settings.resync_s:
            await self._heal_owned(pool, body)
        after = replace(view.observation, adapters=publication.holdings.held)
        return _LastPass(replace(view, observation=after, stored=None), plan, clients,
                         frozenset(adapter_name(result.action) for result in results))

    async def _tell_refusals(self, view: PoolView, routers: RouterView) -> None:
        """A Warning event on each adapter whose requests the routers refused on their API key since its last
        one (api_keys.refusal_events: at most one a minute, counts by status, never a key)."""
        totals = {pod: ack.key_refusals for pod, ack in routers.acks.items() if ack.key_refusals}
        if not totals and not self._refusals.pending:
            return
        messages, self._refusals = refusal_events(self._refusals, totals, view.bodies, time.time())
        await self._post(view.bodies, [Event(name, True, "RequestsRefused", message)
                                       for name, message in messages.items()])

    async def _heal_owned(self, pool: PoolSpec, body: dict) -> None:
        """Re-apply what the pool owns (writes.apply_pool, as on a spec change) and the published placement, once
        per resync: a Deployment, Service, ServiceAccount, Role, RoleBinding or placement ConfigMap someone
        deleted (or edited) comes back within one resync. Deletions of those objects also trigger it at once (the
        watches in handlers.py), and so does a recreated or rotated admin token (the Deployment carries its
        digest: its pods roll)."""
        self._healed_at = time.monotonic()
        self._is_token_new = False
        published, payload = self._memory.published, None
        if published is not None and published.payload:  # "" right after a restart: the next change writes it
            payload = {**json.loads(published.payload), "revision": published.revision}
        await apply_pool(self._kube, body, pool, self._settings, self.admin_token, payload)

    # ---- fetch ----

    def _change(self, changed: frozenset[str] | None, pool: PoolSpec) -> Change | None:
        """What a pass for changed adapters decides for (None: a whole pass): the changed adapters, those the last
        pass called (their cards are the calls' answers) and those whose retry is due."""
        last = self._last
        if (changed is None or last is None or self._memory.previous is None or self.whole_pass_due_s <= 0
                or last.view.pool.fingerprint != pool.fingerprint):
            return None
        now = time.time()
        due = frozenset(name for (_, name), retry in self._memory.retries.items() if retry.retry_at <= now)
        adapters = changed | last.called | due
        return Change(last.plan, adapters) if len(adapters) <= MAX_CHANGED_ADAPTERS else None

    async def _fetch_changed(self, body: dict, pool: PoolSpec, changed: frozenset[str],
                             last: _LastPass) -> tuple[PoolView, _PodClients]:
        """The last pass's view with the pool and the `changed` adapters' objects (and their Secrets) read again."""
        found = await asyncio.gather(*(self._kube.get_custom(names.ADAPTER_PLURAL, self.namespace, name)
                                       for name in sorted(changed)))
        fresh = {a["metadata"]["name"]: a for a in found
                 if a is not None and (a.get("spec") or {}).get("pool") == self.name}
        bodies = {name: a for name, a in last.view.bodies.items() if name not in changed} | fresh
        tokens = {name: t for name, t in last.view.tokens.items() if name not in changed}
        tokens.update(await self._source_tokens(fresh.values()))
        return replace(last.view, pool_body=body, pool=pool, bodies=bodies, tokens=tokens), last.clients

    async def _fetch(self, body: dict, pool: PoolSpec) -> tuple[PoolView, _PodClients]:
        bodies = {a["metadata"]["name"]: a for a in await self._kube.list_custom(names.ADAPTER_PLURAL, self.namespace)
                  if (a.get("spec") or {}).get("pool") == self.name}
        tokens = await self._source_tokens(bodies.values())
        admin_token = await read_admin_token(self._kube, body, pool, self._tokens)
        token = admin_token.value
        if admin_token.is_new or (token is not None and self.admin_token is not None and token != self.admin_token):
            self._is_token_new = True  # recreated or rotated: this pass re-applies the Deployment, its pods roll
        self.admin_token = token
        known = {**admin_token.previous, **self._tokens}  # after a restart: what the Secret kept of earlier ones
        clients = _PodClients(self._session, known, token, self._settings.engine_timeout_s)
        observation = await observe_pool(self._kube, clients.for_pod, self.namespace, self.name)
        self._tokens = remember_tokens(known, token, observation.pods)
        keys = await self._read_keys(pool, body)
        stored = None
        if self._memory.previous is None:  # the first pass: the published placement is the previous one
            stored = StoredPlacement.from_configmap(
                await self._kube.get("ConfigMap", self.namespace, names.placement_configmap_name(self.name)))
        return PoolView(body, pool, bodies, tokens, observation, stored, keys), clients

    async def _read_keys(self, pool: PoolSpec, body: dict) -> PoolKeys | None:
        """The pool's API key table from its key Secrets (None: the pool requires no keys); a refused Secret
        gets one Warning event per version."""
        if not pool.require_api_keys:
            self.key_versions = None
            return None
        keys = read_pool_keys(True, await list_key_secrets(self._kube, self.namespace, self.name))
        self.key_versions = keys.versions
        versions = dict(keys.versions)
        warned = set()
        for refused in keys.refused:
            mark = (refused.name, versions.get(refused.name, ""))
            warned.add(mark)
            if mark not in self._warned_secrets:
                involved = {"apiVersion": "v1", "kind": "Secret",
                            "metadata": {"name": refused.name, "namespace": self.namespace}}
                await self._kube.create_event(involved, "Warning", refused.reason,
                                              f"API key Secret refused for pool {self.name}: {refused.message}")
        self._warned_secrets = frozenset(warned)
        return keys

    async def _push_keys(self, view: PoolView, clients: _PodClients) -> bool:
        """Give each observed engine whose key table differs the pool's; True when a push failed (the next pass
        comes sooner). A pool that requires no keys pushes nothing (its engines run without --require-api-keys)."""
        if view.keys is None:
            return False
        table, observation = view.keys.table, view.observation
        pods = {p["metadata"]["name"]: p for p in observation.pods}
        stale = engines_to_push(table, {pod: observation.key_fingerprints.get(pod) for pod in observation.urls})
        results = await asyncio.gather(*(clients.for_pod(pods[pod]).put_api_keys(observation.urls[pod],
                                                                                  table.to_json())
                                         for pod in stale), return_exceptions=True)
        failed = False
        for pod, result in zip(stale, results):
            if isinstance(result, EngineError):
                log.warning("pool %s/%s: pushing the API key table to %s failed: %s", self.namespace, self.name,
                            pod, result)
                failed = True
            elif isinstance(result, BaseException):
                raise result
        return failed

    async def _source_tokens(self, bodies: Iterable[dict]) -> dict[str, str | S3Access | None]:
        """adapter -> what its spec.source.authSecretRef names: a url's token, an s3 url's key pair (None: the
        Secret or its keys are missing)."""
        refs = {}
        for body in bodies:
            source = (body.get("spec") or {}).get("source") or {}
            ref = source.get("authSecretRef")
            if ref and ref.get("name") and not body["metadata"].get("deletionTimestamp"):
                refs[body["metadata"]["name"]] = (ref["name"], ref.get("key", "token"),
                                                  str(source.get("url") or "").startswith("s3://"))
        values = await asyncio.gather(*(self._read_credentials(*ref) for ref in refs.values()))
        return dict(zip(refs, values))

    async def _read_credentials(self, secret: str, key: str, is_s3: bool) -> str | S3Access | None:
        if not is_s3:
            return await self._kube.read_secret_key(self.namespace, secret, key)
        data = await self._kube.read_secret_data(self.namespace, secret)
        return None if data is None else S3Access.from_secret_data(data)

    # ---- execute ----

    async def _execute(self, plan: PassPlan, clients: _PodClients, view: PoolView) -> list[CallResult]:
        """Run the plan's calls, at most `max_concurrent_calls` at once; each result is recorded as it comes."""
        limit = asyncio.Semaphore(self._settings.max_concurrent_calls)
        results: list[CallResult] = []
        pods = {p["metadata"]["name"]: p for p in view.observation.pods}

        async def run(action: Action) -> None:
            async with limit:
                result = await _call(clients.for_pod(pods[action.pod]), view.observation.urls[action.pod], action)
                self._memory, events = record_result(self._memory, result, plan, time.time(),
                                                     self._settings.backoff_s)
                results.append(result)
                await self._post(view.bodies, events)

        await asyncio.gather(*(run(a) for a in plan.actions))
        return results

    async def _post(self, bodies: Mapping[str, dict], events: Iterable[Event]) -> None:
        for event in events:
            involved = bodies.get(event.adapter)
            if involved is not None:
                await post_event(self._kube, involved, event)

    # ---- publish and patch ----

    async def _publish(self, pool: PoolSpec, body: dict, placement: dict | None) -> None:
        if placement is not None:
            await apply_placement(self._kube, body, pool, placement)

    async def _ask_routers(self, pool: PoolSpec, publication: Publication) -> RouterView:
        """Which revision each router pod routes on, after it was asked to read the one just published."""
        if not pool.router.is_enabled:
            return RouterView(now=time.time())
        acks = await observe_routers(self._kube, self._session, self.namespace, self.name, publication.revision,
                                     ACK_WAIT_S, behind=publication.memory.routers_behind,
                                     behind_wait_s=BEHIND_ACK_WAIT_S)
        return RouterView(acks, time.time())

    async def _patch_adapters(self, bodies: Mapping[str, dict], report: Report) -> None:
        limit = asyncio.Semaphore(STATUS_WRITES_IN_FLIGHT)

        async def write(name: str, new: dict) -> None:
            async with limit:
                await write_status(self._kube, names.ADAPTER_PLURAL, bodies[name], new)

        await asyncio.gather(*(write(name, new) for name, new in report.adapter_statuses.items()))

    async def _patch_pool(self, body: dict, new: dict) -> None:
        await write_status(self._kube, names.POOL_PLURAL, body, new)


class _PodClients:
    """One engine client per admin token; each pod is called with the token it was started with (tokens.py)."""

    def __init__(self, session: aiohttp.ClientSession, known: Mapping[str, str], current: str | None,
                 timeout_s: float) -> None:
        self._session, self._known, self._current, self._timeout_s = session, known, current, timeout_s
        self._clients: dict[str | None, EngineClient] = {}
        self._by_pod: dict[str, str | None] = {}

    def for_pod(self, pod: dict) -> EngineClient:
        token = token_for_pod(pod, self._known, self._current)
        self._by_pod[pod["metadata"]["name"]] = token
        if token not in self._clients:
            self._clients[token] = EngineClient(self._session, token, self._timeout_s)
        return self._clients[token]

    def token(self, pod: str) -> str | None:
        """The token `pod` was called with (the current one for a pod not called yet)."""
        return self._by_pod.get(pod, self._current)


async def _call(client: EngineClient, url: str, action: Action) -> CallResult:
    try:
        if isinstance(action, Unload):
            await client.unload(url, action.adapter)
            return CallResult(action)
        loaded = await client.load(url, action.adapter, is_preload=action.is_preload, is_inplace=action.is_inplace)
    except EngineError as exc:
        return CallResult(action, error=exc)
    return CallResult(action, card=loaded.card)
