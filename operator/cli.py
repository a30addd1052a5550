"""`kubelora operator [flags]`: parse flags and env, then run kopf in this process with our handlers."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

from kubelora.operator.settings import DefaultImages, NetworkPolicySettings, OperatorSettings

ENV_PREFIX = "KUBELORA_OPERATOR_"
DEFAULT_LEASE = "kubelora-operator"
log = logging.getLogger("kubelora.operator")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + name, default)


def build_parser() -> argparse.ArgumentParser:
    defaults = OperatorSettings()
    parser = argparse.ArgumentParser(prog="kubelora operator",
                                     description="Run the kubelora control plane (LoRAPool, LoRAAdapter).")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=None,
                       help="watch this namespace (repeatable; env KUBELORA_OPERATOR_NAMESPACES, comma-separated)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster (default)")
    parser.add_argument("--liveness", type=int, default=_int_env("LIVENESS_PORT"), metavar="PORT",
                        help="serve kopf's liveness probe on http://0.0.0.0:PORT/healthz")
    parser.add_argument("--metrics-port", type=int, default=_int_env("METRICS_PORT"), metavar="PORT",
                        help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics "
                             "(env KUBELORA_OPERATOR_METRICS_PORT; default off)")
    parser.add_argument("--resync-seconds", type=float, default=_float_env("RESYNC_S", defaults.resync_s),
                        help=f"reconcile each pool at least this often (default {defaults.resync_s})")
    parser.add_argument("--max-concurrent-calls", type=int,
                        default=_int_env("MAX_CONCURRENT_CALLS") or defaults.max_concurrent_calls,
                        help="engine load/unload calls in flight per pool")
    parser.add_argument("--engine-timeout-seconds", type=float,
                        default=_float_env("ENGINE_TIMEOUT_S", defaults.engine_timeout_s))
    parser.add_argument("--backoff-initial-seconds", type=float,
                        default=_float_env("BACKOFF_INITIAL_S", defaults.backoff_initial_s))
    parser.add_argument("--backoff-max-seconds", type=float,
                        default=_float_env("BACKOFF_MAX_S", defaults.backoff_max_s))
    parser.add_argument("--verbose", action="store_true", default=_env("VERBOSE", "") in ("1", "true"))
    parser.add_argument("--engine-image", default=_env("ENGINE_IMAGE") or defaults.images.engine,
                        help=f"engine image of pools that name none (default {defaults.images.engine})")
    parser.add_argument("--router-image", default=_env("ROUTER_IMAGE") or defaults.images.router,
                        help=f"router image of pools that name none (default {defaults.images.router})")
    add_election_flags(parser)
    add_network_policy_flags(parser)
    return parser


def add_network_policy_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine NetworkPolicy (one per pool; docs/operator.md, closed by default)")
    group.add_argument("--network-policy", action=argparse.BooleanOptionalAction,
                       default=_env("NETWORK_POLICY", "true").lower() not in ("0", "false", "no"),
                       help="create a NetworkPolicy per pool (env KUBELORA_OPERATOR_NETWORK_POLICY; default on)")
    group.add_argument("--operator-pod-labels", default=_env("POD_LABELS"), metavar="K=V,...",
                       help="labels of this operator's pods, the only peers the admin port admits "
                            "(env KUBELORA_OPERATOR_POD_LABELS; default app.kubernetes.io/component=operator)")
    group.add_argument("--operator-namespace", default=_env("POD_NAMESPACE"), metavar="NS",
                       help="this operator's namespace (env KUBELORA_OPERATOR_POD_NAMESPACE, else POD_NAMESPACE, "
                            "else the service account's; unknown: pods with those labels in any namespace)")


def add_election_flags(parser: argparse.ArgumentParser) -> None:
    from kubelora.operator.leader import ElectionSettings

    defaults = ElectionSettings("-", "-", "-")
    group = parser.add_argument_group("leader election (several replicas, one active)")
    group.add_argument("--leader-elect", action="store_true", default=_env("LEADER_ELECT", "") in ("1", "true"),
                       help="run kopf only while holding a coordination.k8s.io Lease "
                            "(env KUBELORA_OPERATOR_LEADER_ELECT)")
    group.add_argument("--leader-elect-lease", default=_env("LEADER_ELECT_LEASE") or DEFAULT_LEASE, metavar="NAME")
    group.add_argument("--leader-elect-namespace", default=_env("LEADER_ELECT_NAMESPACE"), metavar="NS",
                       help="the Lease's namespace (default: env POD_NAMESPACE, else the service account's)")
    group.add_argument("--leader-elect-identity", default=_env("LEADER_ELECT_IDENTITY"),
                       help="this replica's holder identity (default: env POD_NAME or the host name, plus a "
                            "random suffix)")
    group.add_argument("--leader-elect-lease-seconds", type=int,
                       default=_int_env("LEADER_ELECT_LEASE_S") or defaults.lease_duration_s)
    group.add_argument("--leader-elect-renew-seconds", type=float,
                       default=_float_env("LEADER_ELECT_RENEW_S", defaults.renew_deadline_s))
    group.add_argument("--leader-elect-retry-seconds", type=float,
                       default=_float_env("LEADER_ELECT_RETRY_S", defaults.retry_period_s))


def _int_env(name: str) -> int | None:
    value = _env(name)
    return int(value) if value else None


def _float_env(name: str, default: float) -> float:
    value = _env(name)
    return float(value) if value else default


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    return OperatorSettings(resync_s=args.resync_seconds, max_concurrent_calls=args.max_concurrent_calls,
                            engine_timeout_s=args.engine_timeout_seconds,
                            backoff_initial_s=args.backoff_initial_seconds, backoff_max_s=args.backoff_max_seconds,
                            images=DefaultImages(engine=args.engine_image, router=args.router_image),
                            network_policy=network_policy_from_args(args))


def network_policy_from_args(args: argparse.Namespace) -> NetworkPolicySettings:
    from kubelora.operator.leader import SERVICE_ACCOUNT_NAMESPACE

    namespace = args.operator_namespace or os.environ.get("POD_NAMESPACE") or ""
    if not namespace and Path(SERVICE_ACCOUNT_NAMESPACE).is_file():
        namespace = Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip()
    if args.operator_pod_labels is None:
        return NetworkPolicySettings(is_enabled=args.network_policy, operator_namespace=namespace)
    return NetworkPolicySettings(is_enabled=args.network_policy, operator_namespace=namespace,
                                 operator_pod_labels=NetworkPolicySettings.parse_labels(args.operator_pod_labels))


def settings_from_env() -> OperatorSettings:
    """For `kopf run -m kubelora.operator.main`, where no flags reach us: the environment and defaults."""
    return settings_from_args(build_parser().parse_args([]))


def election_from_args(args: argparse.Namespace):
    """The election's settings, or None without --leader-elect. Raises ValueError for bad values."""
    from kubelora.operator.leader import SERVICE_ACCOUNT_NAMESPACE, ElectionSettings

    if not args.leader_elect:
        return None
    namespace = args.leader_elect_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace and Path(SERVICE_ACCOUNT_NAMESPACE).is_file():
        namespace = Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip()
    if not namespace:
        raise ValueError("--leader-elect needs --leader-elect-namespace (or env POD_NAMESPACE) outside a pod")
    # As kube-controller-manager: the pod's name plus a random suffix, so that a restarted container is a new
    # candidate and never mistakes its dead predecessor's Lease for its own.
    identity = args.leader_elect_identity or (
        f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}")
    return ElectionSettings(lease_name=args.leader_elect_lease, namespace=namespace, identity=identity,
                            lease_duration_s=args.leader_elect_lease_seconds,
                            renew_deadline_s=args.leader_elect_renew_seconds,
                            retry_period_s=args.leader_elect_retry_seconds)


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv[:1] == ["--"]:  # `kubelora operator -- --namespace x`: the separator some parsers pass through
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        election = election_from_args(args)
    except ValueError as exc:
        print(f"kubelora operator: {exc}")
        return 2
    namespaces = args.namespace or [n for n in (_env("NAMESPACES") or "").split(",") if n]
    if args.metrics_port:
        from kubelora.operator.metrics import serve

        serve(args.metrics_port)
    return run(settings, namespaces, args.liveness, args.verbose, election)


def run(settings: OperatorSettings, namespaces: list[str], liveness_port: int | None, is_verbose: bool,
        election=None) -> int:
    """kopf with our handlers; with `election` (leader.ElectionSettings) only while this replica leads. Returns the
    exit code: 0 after SIGTERM/SIGINT, 1 when leadership was lost (the pod restarts as a standby)."""
    import kopf

    from kubelora.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=is_verbose)
    if not is_verbose:  # the library logs every retry of a standby at INFO
        logging.getLogger("leaderelection").setLevel(logging.WARNING)
    liveness = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None
    memo = kopf.Memo(operator_settings=settings)
    operator = functools.partial(kopf.operator, standalone=True, clusterwide=not namespaces,
                                 namespaces=namespaces or (), liveness_endpoint=liveness, memo=memo)
    try:
        return asyncio.run(operate(operator, election, liveness_port, memo))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0


async def operate(operator, election, liveness_port: int | None, memo: dict | None = None) -> int:
    """`operator(stop_flag=...)` runs kopf until SIGTERM/SIGINT (kopf's own handlers) or the flag is set. memo:
    kopf's memo, given `release_leadership`, which the cleanup handler calls as soon as kopf's handlers have
    stopped (handlers.on_cleanup); the release after kopf returns is then a no-op."""
    from kubelora.operator.metrics import METRICS

    if election is None:
        METRICS.set_leader(True)
        await operator()
        return 0
    from kubelora.operator.leader import LeaderElector, load_api_client, stand_by

    elector = LeaderElector(election, await asyncio.to_thread(load_api_client))
    elector.start()
    try:
        METRICS.set_leader(False)
        if not await stand_by(elector, liveness_port):
            return 0
        METRICS.set_leader(True)
        if memo is not None:
            memo["release_leadership"] = elector.release
        await operator(stop_flag=elector.lost)
        if elector.lost.is_set() and not elector.is_released:  # released on purpose: renewals stop, no loss
            log.error("lost the Lease %s/%s: exiting so that this pod restarts as a standby", election.namespace,
                      election.lease_name)
            return 1
        return 0
    finally:
        METRICS.set_leader(False)
        if await elector.release():  # a standby takes over at its next retry, not after the lease runs out
            log.info("released the Lease %s/%s", election.namespace, election.lease_name)
