"""One thread per pod: sandbox (network namespace, volumes), containers, status, teardown."""
from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from . import network
from .apiclient import STRATEGIC_PATCH, ApiClient, ApiError
from .config import KubeletConfig
from .container import Backoff, ContainerRunner, Termination
from .envvars import EnvError, PodEnvContext, build_env, expand
from .images import UnknownEntrypoint, build_argv
from .imagestore import ImageError, ImageStore
from .launch import LaunchSpec, build_mounts
from .probes import ProbeTarget
from .runtime import (DEFAULT_PATH, Bundle, ContainerMount, SecurityError, build_command, build_config,
                      build_exec_command, resolve_user, write_bundle)
from .status import ConditionClock, PodPhase, PodView, build_pod_status, has_drifted
from .timeutil import now_rfc3339
from .volumes import VolumeContext, VolumeError, prepare_volumes

TICK_S = 0.25
RETRY_S = 2.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerDeps:
    cfg: KubeletConfig
    api: ApiClient
    ips: network.IpAllocator
    images: ImageStore


class PodWorker(threading.Thread):
    def __init__(self, pod: dict, deps: WorkerDeps) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.pod = pod
        self.uid: str = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self._deps = deps
        self._pod_dir = deps.cfg.pods_dir / self.uid
        backoff = Backoff(deps.cfg.restart_backoff_base_s, deps.cfg.restart_backoff_max_s)
        spec = pod["spec"]
        self.init_runners = tuple(ContainerRunner(c, self._pod_dir, backoff)
                                  for c in spec.get("initContainers", []))
        self.runners = tuple(ContainerRunner(c, self._pod_dir, backoff)
                             for c in spec["containers"])
        self._restart_policy: str = spec.get("restartPolicy", "Always")
        self._finished: set[str] = set()   # containers that will not run again
        self._is_initialized = not self.init_runners
        self._has_failed_init = False
        self._pod_ip = ""
        self._netns: str | None = None
        self._volume_paths: dict = {}
        self._start_time = now_rfc3339()
        self._clock = ConditionClock()
        self._last_status = ""
        self._written: dict | None = None  # the status last written, and the resourceVersion that write made
        self._written_version = 0
        self._message = ""
        self._stop_requested = threading.Event()
        self._grace_s = float(spec.get("terminationGracePeriodSeconds", 30))
        self._delete_from_api = False

    # -- control from the sync loop ----------------------------------------------------------
    def request_stop(self, grace_s: float, delete_from_api: bool) -> None:
        self._grace_s = min(self._grace_s, grace_s)
        self._delete_from_api |= delete_from_api
        self._stop_requested.set()

    def find_runner(self, name: str) -> ContainerRunner | None:
        return next((r for r in (*self.init_runners, *self.runners) if r.name == name), None)

    # -- thread body -------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stop_requested.is_set() and not self._setup_sandbox():
                self._push_status()
                self._stop_requested.wait(RETRY_S)
            while not self._stop_requested.is_set():
                if self._phase() not in (PodPhase.SUCCEEDED, PodPhase.FAILED):
                    self._tick()
                self._push_status()
                self._stop_requested.wait(TICK_S)
        except Exception:  # noqa: BLE001 - a pod bug must not leak its processes
            log.exception("pod %s worker crashed", self.key)
        finally:
            self._terminate()

    def _setup_sandbox(self) -> bool:
        cfg = self._deps.cfg
        try:
            if not self._pod_ip:
                self._create_network()
            volume_ctx = VolumeContext(self._deps.api, self.pod, self._pod_dir, cfg.node_ip)
            self._volume_paths = prepare_volumes(volume_ctx)
        except (VolumeError, ApiError, OSError) as error:
            self._message = f"setting up pod: {error}"
            log.warning("pod %s: %s", self.key, self._message)
            return False
        self._message = ""
        return True

    def _create_network(self) -> None:
        if self.pod["spec"].get("hostNetwork"):
            self._pod_ip = self._deps.cfg.node_ip
            return
        address = self._deps.ips.allocate(wanted=(self.pod.get("status") or {}).get("podIP", ""))
        try:
            self._netns = network.create_pod_netns(self.uid, address, self._deps.ips.prefixlen,
                                                   self._deps.cfg.netns_record_dir)
        except Exception:
            self._deps.ips.release(address)
            raise
        self._pod_ip = address

    # -- containers --------------------------------------------------------------------------
    def _tick(self) -> None:
        if not self._is_initialized:
            self._tick_init()
            return
        target = self._probe_target()
        for runner in self.runners:
            if runner.name in self._finished:
                continue
            if runner.is_running:
                self._check_running(runner, self._container_target(runner, target))
            elif runner.can_start(time.monotonic()):
                self._start(runner)

    def _tick_init(self) -> None:
        """Init containers run one at a time, in order, each to successful completion."""
        runner = next(r for r in self.init_runners if r.name not in self._finished)
        if runner.is_running:
            termination = runner.poll_exit()
            if termination is not None:
                self._on_exit(runner, termination, is_init=True)
        elif runner.can_start(time.monotonic()):
            self._start(runner)
        self._is_initialized = all(r.name in self._finished for r in self.init_runners) \
            and not self._has_failed_init

    def _check_running(self, runner: ContainerRunner, target: ProbeTarget) -> None:
        termination = runner.poll_exit()
        if termination is None and not runner.run_due_probes(target):
            log.info("pod %s: container %s failed its liveness probe", self.key, runner.name)
            grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
            termination = runner.kill(grace)
        if termination is not None:
            self._on_exit(runner, termination, is_init=False)

    def _on_exit(self, runner: ContainerRunner, termination: Termination, is_init: bool) -> None:
        if self._should_restart(termination.exit_code == 0, is_init):
            runner.schedule_restart(termination)
            return
        self._finished.add(runner.name)
        self._has_failed_init |= is_init and termination.exit_code != 0

    def _should_restart(self, is_success: bool, is_init: bool) -> bool:
        """restartPolicy semantics; an init container that succeeded is done for good."""
        if self._restart_policy == "Never" or (is_init and is_success):
            return False
        return self._restart_policy == "Always" or not is_success

    def _start(self, runner: ContainerRunner) -> None:
        try:
            runner.start(self._build_launch(runner))
        except ImageError as error:
            runner.mark_waiting("ErrImageNeverPull", str(error), RETRY_S)
        except (EnvError, UnknownEntrypoint, SecurityError, ApiError, OSError, KeyError) as error:
            runner.mark_waiting("CreateContainerConfigError", str(error), RETRY_S)

    def _build_launch(self, runner: ContainerRunner) -> LaunchSpec:
        """The container from its image, with runc: image env under the pod's, the image's user unless the
        securityContext says otherwise, volumes as bind mounts."""
        cfg = self._deps.cfg
        env = build_env(PodEnvContext(self._deps.api, self.pod, self._pod_ip, cfg.node_ip,
                                      cfg.apiserver_port), runner.spec)
        image = self._deps.images.get(runner.spec.get("image", ""))
        user = resolve_user(self.pod["spec"], runner.spec, image)
        env = {"PATH": DEFAULT_PATH, **dict(image.config.env), "HOME": "/root" if user.uid == 0 else "/", **env}
        argv = tuple(expand(arg, env) for arg in build_argv(runner.spec, image.config))
        binds = build_mounts(runner.spec, self._volume_paths)
        if self._netns:  # a real kubelet's /etc/hosts: the pod's name at its IP
            binds += (ContainerMount(self._write_hosts_file(), "/etc/hosts", True),)
        container_id = f"{network.netns_name(self.uid)}-{runner.name}-{runner.restart_count}"
        bundle = Bundle(container_id, self._pod_dir / "bundles" / f"{runner.name}-{runner.restart_count}")
        config = build_config(image, argv, env, user, runner.spec.get("workingDir") or image.config.working_dir,
                              self.pod["metadata"]["name"], self._netns, binds,
                              runner.spec.get("securityContext") or {})
        write_bundle(bundle, config)
        command = build_command(bundle, image, runner.pid_file)
        return LaunchSpec(tuple(command), (("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),),
                          runner.log_path(runner.restart_count), container_id)

    def _write_hosts_file(self) -> Path:
        path = self._pod_dir / "etc-hosts"
        path.write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                        f"{self._pod_ip}\t{self.pod['metadata']['name']}\n")
        return path

    @staticmethod
    def _container_target(runner: ContainerRunner, target: ProbeTarget) -> ProbeTarget:
        return replace(target, exec_prefix=tuple(build_exec_command(runner.container_id or "", [])))

    def _probe_target(self) -> ProbeTarget:
        ports = {p["name"]: p["containerPort"] for c in self.runners
                 for p in c.spec.get("ports", []) if p.get("name")}
        return ProbeTarget(self._pod_ip, ports, {"PATH": "/usr/sbin:/usr/bin:/bin"})

    # -- status ------------------------------------------------------------------------------
    def _phase(self) -> PodPhase:
        if self._has_failed_init:
            return PodPhase.FAILED
        num_containers = len(self.init_runners) + len(self.runners)
        if self._is_initialized and len(self._finished) == num_containers:
            is_success = all(r.last_termination and r.last_termination.exit_code == 0
                             for r in self.runners)
            return PodPhase.SUCCEEDED if is_success else PodPhase.FAILED
        if self._is_initialized and any(r.has_run for r in self.runners):
            return PodPhase.RUNNING
        return PodPhase.PENDING

    def _push_status(self) -> None:
        view = PodView(self.uid, self._phase(), self._pod_ip, self._deps.cfg.node_ip,
                       self._start_time, bool(self._pod_ip), self.init_runners, self.runners,
                       self._is_initialized, self._message)
        status = build_pod_status(view, self._clock)
        encoded = json.dumps(status, sort_keys=True)
        if encoded == self._last_status and not self._has_drifted():
            return
        meta = self.pod["metadata"]
        try:
            written = self._deps.api.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
                                           "/status", {"status": status}, STRATEGIC_PATCH)
            self._last_status, self._written = encoded, status
            self._written_version = resource_version(written)
        except ApiError as error:
            if error.status == 404:
                self._stop_requested.set()
            else:
                log.warning("pod %s: status update failed: %s", self.key, error)
        except OSError as error:  # the API server is down or restarting: the next tick writes it again
            log.warning("pod %s: status update failed, API server unreachable: %s", self.key, error)

    def _has_drifted(self) -> bool:
        """Whether the pod as last listed (every sync period) lost the status this kubelet wrote; a listing older
        than that write cannot tell."""
        if self._written is None or resource_version(self.pod) < self._written_version:
            return False
        if has_drifted(self._written, self.pod.get("status") or {}):
            log.info("pod %s: its status in the API differs from the kubelet's; writing it again", self.key)
            return True
        return False

    # -- teardown ----------------------------------------------------------------------------
    def _terminate(self) -> None:
        """Stop every container (in parallel, each with the grace period), free the
        sandbox, then let the API server forget the pod if it asked for its deletion."""
        running = [r for r in (*self.init_runners, *self.runners) if r.is_running]
        if running:
            with ThreadPoolExecutor(len(running)) as pool:
                list(pool.map(lambda r: r.kill(self._grace_s), running))
            self._finished.update(r.name for r in running)
        if self._netns:
            network.delete_pod_netns(self.uid, self._deps.cfg.netns_record_dir)
            self._deps.ips.release(self._pod_ip)
        if self._delete_from_api:
            self._push_status()
            self._delete_pod()
        shutil.rmtree(self._pod_dir, ignore_errors=True)

    def _delete_pod(self) -> None:
        meta = self.pod["metadata"]
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                "preconditions": {"uid": self.uid}}
        try:
            self._deps.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                  body)
        except ApiError as error:
            if error.status not in (404, 409):
                log.warning("pod %s: delete failed: %s", self.key, error)
        except OSError as error:  # the pod stays listed; the next sync asks this worker's successor again
            log.warning("pod %s: delete failed, API server unreachable: %s", self.key, error)


def resource_version(obj: dict) -> int:
    """etcd revisions, as kube-apiserver's resourceVersions are (opaque to clients in general; this kubelet talks
    only to its own API server). 0 when absent or not a number: then every listing counts as newer."""
    try:
        return int(obj.get("metadata", {}).get("resourceVersion", 0))
    except ValueError:
        return 0
