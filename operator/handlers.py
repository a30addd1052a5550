"""kopf handlers: read the custom resource, write what it owns and its status (writes.py); the reconcile does the
rest.

Handler ids are the function names (kopf stores progress under them): renaming one is a behaviour change.
- LoRAPool create/update/resume: apply the engine Deployment, Services and the router (owned by the pool).
- LoRAPool daemon: the pool's level-based reconcile, a whole pass every `resync_s` and whenever triggered.
- LoRAAdapter events trigger a pass for the adapters that changed; engine pod events a whole pass.
- LoRAAdapter deletion (finalizer): best-effort unload from the pool's ready pods, never hanging.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import kopf

from kubelora.operator import names
from kubelora.operator.api_keys import watch_key_secrets
from kubelora.operator.engine_client import EngineClient, EngineError
from kubelora.operator.kube import Kube, KubeError, load_connection
from kubelora.operator.observe import is_pod_ready, pod_admin_url
from kubelora.operator.metered import MeteredReconciler
from kubelora.operator.metrics import METRICS
from kubelora.operator.report import invalid_pool_status
from kubelora.operator.runtime import Runtime
from kubelora.operator.settings import OperatorSettings
from kubelora.operator.cli import settings_from_env
from kubelora.operator.specs import AdapterSpec, InvalidSpec, PoolSpec
from kubelora.operator.watch import PodWatchers
from kubelora.operator.status import POOL_NOT_FOUND, Failure, build_adapter_status
from kubelora.operator.writes import apply_pool, read_admin_token, write_status

FINALIZER = "kubelora.io/finalizer"
UNLOAD_ON_DELETE_TIMEOUT_S = 5.0


@kopf.on.startup()
async def on_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kubelora.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kubelora.io")
    settings.posting.level = logging.WARNING  # our own events describe loads; kopf's would repeat them
    operator_settings = memo.get("operator_settings") or settings_from_env()
    connection = await asyncio.to_thread(load_connection)
    kube_session = aiohttp.ClientSession()
    memo.runtime = Runtime(settings=operator_settings, kube=Kube(connection, kube_session),
                           kube_session=kube_session, engine_session=aiohttp.ClientSession())


@kopf.on.cleanup()
async def on_cleanup(memo: kopf.Memo, **_: Any) -> None:
    """kopf runs this once its watchers and daemons have stopped: nothing of ours acts any more. So the Lease
    goes now (cli.operate puts its release in the memo): kopf's own exit afterwards waits up to 5 s for tasks
    still running (kopf.reactor.running.run_tasks), and a standby must not wait for that."""
    release_leadership = memo.get("release_leadership")
    if release_leadership is not None:
        await release_leadership()
    runtime: Runtime | None = memo.get("runtime")
    if runtime is not None:
        await runtime.close()


# ---- LoRAPool ----

@kopf.on.resume(names.GROUP, names.VERSION, names.POOL_PLURAL)
@kopf.on.create(names.GROUP, names.VERSION, names.POOL_PLURAL)
@kopf.on.update(names.GROUP, names.VERSION, names.POOL_PLURAL, field="spec")
async def on_pool_spec(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    runtime: Runtime = memo.runtime
    try:
        pool = PoolSpec.from_body(body)
    except InvalidSpec as exc:
        status = invalid_pool_status(body["metadata"]["name"], body, Failure(exc.reason, str(exc)))
        await write_status(runtime.kube, names.POOL_PLURAL, body, status)
        raise kopf.PermanentError(str(exc)) from exc
    try:
        token = await read_admin_token(runtime.kube, body, pool)
        await apply_pool(runtime.kube, body, pool, runtime.settings, token.value)
    except (KubeError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise kopf.TemporaryError(f"applying the pool's objects failed: {exc}", delay=5) from exc
    logger.info("applied the engine Deployment (%d replicas) and Services", pool.replicas)
    runtime.trigger(pool.namespace, pool.name)


@kopf.daemon(names.GROUP, names.VERSION, names.POOL_PLURAL, cancellation_timeout=2.0)
async def daemon_pool(name: str, namespace: str, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                      logger: logging.Logger, **_: Any) -> None:
    runtime: Runtime = memo.runtime
    reconciler = MeteredReconciler(runtime.kube, runtime.engine_session, runtime.settings, namespace, name,
                                   on_released=lambda adapters: runtime.mark_released(namespace, name, adapters),
                                   take_heal_request=lambda: runtime.take_heal_request(namespace, name))
    wake = runtime.trigger_for(namespace, name)
    watchers = PodWatchers(lambda token: EngineClient(runtime.engine_session, token, runtime.settings.engine_timeout_s),
                           lambda: runtime.trigger(namespace, name))
    key_watch = asyncio.create_task(watch_key_secrets(runtime.kube, namespace, name, lambda: reconciler.key_versions,
                                                      lambda: runtime.trigger(namespace, name)))
    try:
        while not stopped:
            wake.clear()
            try:
                await reconciler.reconcile(runtime.take_changes(namespace, name))
            except (KubeError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                logger.warning("reconcile failed, retrying: %s", exc)
            except Exception:  # noqa: BLE001 - a bug in one run must not stop the pool's reconcile for good
                logger.exception("reconcile failed")
            watchers.update(reconciler.observed_tokens)
            try:  # sooner while a router lags the published placement (its Ready and Degraded follow)
                await asyncio.wait_for(wake.wait(), timeout=min(reconciler.whole_pass_due_s,
                                                                reconciler.next_pass_s or runtime.settings.resync_s))
            except asyncio.TimeoutError:
                pass
            await gather_triggers(wake, runtime.settings.debounce_s, runtime.settings.max_gather_s)
    finally:
        key_watch.cancel()
        runtime.forget(namespace, name)
        METRICS.forget_pool(namespace, name)
        await watchers.close()


async def gather_triggers(wake: asyncio.Event, debounce_s: float, max_gather_s: float) -> None:
    """Wait until no trigger has come for `debounce_s` (a burst: deletes one by one, a GitOps sync, or the events of
    one object's create), at most `max_gather_s` in all: a burst shares a few passes, a lone change waits
    `debounce_s` after its last event."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_gather_s
    while True:
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), timeout=min(debounce_s, max(deadline - loop.time(), 0)))
        except asyncio.TimeoutError:
            return
        if loop.time() >= deadline:
            return


@kopf.on.event(names.GROUP, names.VERSION, names.POOL_PLURAL)
async def on_pool_event(body: kopf.Body, event: dict, memo: kopf.Memo, **_: Any) -> None:
    """A deleted pool leaves its adapters Pending (PoolNotFound) instead of a stale Ready."""
    if event.get("type") != "DELETED":
        return
    runtime: Runtime = memo.runtime
    meta = body["metadata"]
    for adapter in await runtime.kube.list_custom(names.ADAPTER_PLURAL, meta["namespace"]):
        if (adapter.get("spec") or {}).get("pool") == meta["name"] and not adapter["metadata"].get(
                "deletionTimestamp"):
            await _write_pool_not_found(runtime, adapter, meta["name"])


# ---- LoRAAdapter ----

@kopf.on.event(names.GROUP, names.VERSION, names.ADAPTER_PLURAL)
async def on_adapter_event(body: kopf.Body, event: dict, memo: kopf.Memo, **_: Any) -> None:
    """Spec changes, creations, deletions and a new retry request (annotation kubelora.io/retry) reach the pool's
    reconcile at once; status writes do not."""
    runtime: Runtime = memo.runtime
    meta, status = body["metadata"], body.get("status") or {}
    pool = (body.get("spec") or {}).get("pool", "")
    is_answered = (status.get("retryRequest") or "") == names.retry_request(body)
    is_settled = (status.get("observedGeneration") == meta.get("generation") and not meta.get("deletionTimestamp")
                  and is_answered)
    if event.get("type") not in (None, "ADDED", "DELETED") and is_settled:
        return
    if runtime.has_pool(meta["namespace"], pool):
        runtime.trigger_adapter(meta["namespace"], pool, meta["name"])
    elif event.get("type") != "DELETED" and not meta.get("deletionTimestamp"):
        await _write_pool_not_found(runtime, body, pool)


async def _write_pool_not_found(runtime: Runtime, body: kopf.Body, pool: str) -> None:
    meta = body["metadata"]
    if await runtime.kube.get_custom(names.POOL_PLURAL, meta["namespace"], pool) is not None:
        return  # its daemon is starting and will write the status
    try:
        revision = AdapterSpec.from_body(body).source.revision
    except InvalidSpec:
        revision = ""
    message = f"LoRAPool {pool!r} not found in namespace {meta['namespace']!r}"
    status = build_adapter_status(generation=int(meta.get("generation") or 0), revision=revision, wanted=0,
                                  replicas=[], pending=Failure(POOL_NOT_FOUND, message))
    await write_status(runtime.kube, names.ADAPTER_PLURAL, body, status)  # a Warning once, on turning PoolNotFound


@kopf.on.delete(names.GROUP, names.VERSION, names.ADAPTER_PLURAL)
async def on_adapter_delete(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """The pool's reconcile unloads it (an adapter being deleted is never placed, and unloaded wherever it is
    observed); this waits for that pass, bounded, so the finalizer goes only once the pods let it go. Adapters
    deleted together share passes, and each (pod, adapter) gets one unload. Without a running reconcile (its pool is
    gone or not yet handled here) it unloads from the ready pods itself, best effort. Pods that are gone or
    unreachable are skipped either way: one that comes back is cleaned up by the reconcile, which unloads what no
    adapter names."""
    runtime: Runtime = memo.runtime
    meta, pool_name = body["metadata"], (body.get("spec") or {}).get("pool", "")
    namespace = meta["namespace"]
    if runtime.has_pool(namespace, pool_name):
        if not await runtime.wait_released(namespace, pool_name, meta["name"], release_timeout_s(runtime.settings)):
            logger.warning("deleting %s: its pool's reconcile did not unload it in time; the next pass will",
                           meta["name"])
        return
    try:
        token = await _pool_admin_token(runtime, namespace, pool_name)
        selector = names.selector_string(names.engine_selector(pool_name))
        pods = [p for p in await runtime.kube.list_pods(namespace, selector) if is_pod_ready(p)]
    except (KubeError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        logger.warning("not unloading %s: listing its pool's pods failed: %s", meta["name"], exc)
        pods, token = [], None
    client = EngineClient(runtime.engine_session, token, UNLOAD_ON_DELETE_TIMEOUT_S)
    results = await asyncio.gather(*(client.unload(pod_admin_url(p), meta["name"]) for p in pods),
                                   return_exceptions=True)
    for pod, result in zip(pods, results):
        if isinstance(result, EngineError):
            logger.warning("unload from %s failed (ignored): %s", pod["metadata"]["name"], result)
    runtime.trigger(namespace, pool_name)


def release_timeout_s(settings: OperatorSettings) -> float:
    """How long a deletion waits for the reconcile: one resync (a pass that started before the deletion finishes
    first), plus the engine calls of one pass."""
    return settings.resync_s + settings.engine_timeout_s / 4


async def _pool_admin_token(runtime: Runtime, namespace: str, pool_name: str) -> str | None:
    pool = await runtime.kube.get_custom(names.POOL_PLURAL, namespace, pool_name)
    if pool is None:
        return None
    ref = (pool.get("spec") or {}).get("adminTokenSecretRef") or {"name": names.admin_token_secret_name(pool_name),
                                                                  "key": names.ADMIN_TOKEN_KEY}
    return await runtime.kube.read_secret_key(namespace, ref["name"], ref.get("key", "token"))


# ---- objects a pool owns ----

OWNED_KINDS = (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "serviceaccounts"),
               ("", "v1", "configmaps"), ("rbac.authorization.k8s.io", "v1", "roles"),
               ("rbac.authorization.k8s.io", "v1", "rolebindings"), ("networking.k8s.io", "v1", "networkpolicies"))


async def on_owned_event(event: dict, labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A pool's Deployment, Service, ServiceAccount, Role, RoleBinding, ConfigMap or NetworkPolicy was deleted: its
    next pass, now, re-applies what the pool owns (a pool being deleted has no daemon left to ask, or its pass
    sees the deletion and stops). The admin token Secret is not watched (that needs list/watch on every Secret of
    the namespace): the next pass that finds it missing creates a new one (writes.read_admin_token)."""
    pool = labels.get(names.LABEL_POOL)
    if event.get("type") == "DELETED" and pool:
        memo.runtime.request_heal(namespace, pool)


for _group, _version, _plural in OWNED_KINDS:
    kopf.on.event(_group, _version, _plural, labels={names.LABEL_MANAGED_BY: names.MANAGED_BY})(on_owned_event)


# ---- engine pods ----

@kopf.on.event("", "v1", "pods", labels={names.LABEL_COMPONENT: "engine", names.LABEL_MANAGED_BY: names.MANAGED_BY})
async def on_engine_pod_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A pod that turns ready, restarts or goes away changes what the pool's reconcile must do."""
    runtime: Runtime = memo.runtime
    pool = labels.get(names.LABEL_POOL)
    if pool:
        runtime.trigger(namespace, pool)
