"""The operator's settings: one frozen dataclass per component, filled from the `SETTINGS` table (flags first,
`KUBELORA_OPERATOR_*` variables second, the dataclasses' defaults last); docs/operator.md lists the same rows."""

from __future__ import annotations

import argparse
import functools
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from kubelora.contract import settings
from kubelora.contract.settings import Setting, parse_bool

ENV_PREFIX = "KUBELORA_OPERATOR_"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _own_version() -> str:
    try:
        return metadata.version("kubelora")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "dev"


VERSION = _own_version()


@dataclass(frozen=True)
class DefaultImages:
    """The images a pool gets when its spec leaves `image` / `router.image` empty: this operator's own version.

    The chart renders them (registry, names, its appVersion); these defaults are the names `make images` builds.
    The router runs from the control-plane image, the operator's own, with the router command.
    """

    engine: str = f"kubelora-engine:{VERSION}"
    router: str = f"kubelora-operator:{VERSION}"

    def __post_init__(self) -> None:
        for name in ("engine", "router"):
            value = getattr(self, name)
            if not value or any(c.isspace() for c in value):
                raise ValueError(f"{name} image must be a non-empty image reference without spaces, got {value!r}")


@dataclass(frozen=True)
class NetworkPolicySettings:
    """Per pool, a NetworkPolicy on the engine pods (docs/operator.md, "Closed by default"): the admin port only
    from the operator's pods, the serving port only from the pool's routers and its allowed client namespaces.

    `operator_namespace` and `operator_pod_labels` select the operator's pods; the chart renders both. An empty
    namespace admits pods with those labels in any namespace (an operator run outside the chart).
    """

    is_enabled: bool = True
    operator_namespace: str = ""
    operator_pod_labels: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/component": "operator"})

    def __post_init__(self) -> None:
        if self.is_enabled and not self.operator_pod_labels:
            raise ValueError("operator_pod_labels must name at least one label when the network policy is on "
                             "(an empty selector would admit every pod)")

    @staticmethod
    def parse_labels(text: str) -> dict[str, str]:
        """`k=v,k2=v2` (a label selector of equalities) -> {k: v, k2: v2}; ValueError naming the bad item."""
        labels = {}
        for item in (i.strip() for i in text.split(",") if i.strip()):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"operator pod labels: expected KEY=VALUE, got {item!r}")
            labels[key.strip()] = value.strip()
        return labels


@dataclass(frozen=True)
class OperatorSettings:
    resync_s: float = 30.0  # full reconcile of each pool at least this often, besides event triggers
    debounce_s: float = 0.2  # triggers within this window share one reconcile
    max_gather_s: float = 2.0  # while triggers keep coming closer than debounce_s, a pass waits at most this long
    max_concurrent_calls: int = 4  # engine load/unload calls in flight per pool
    engine_timeout_s: float = 120.0  # one engine call (a load reads and validates the adapter)
    backoff_initial_s: float = 1.0  # first retry after a transient engine failure; doubles per failure
    backoff_max_s: float = 60.0
    images: DefaultImages = field(default_factory=DefaultImages)
    network_policy: NetworkPolicySettings = field(default_factory=NetworkPolicySettings)

    def __post_init__(self) -> None:
        for name in ("resync_s", "engine_timeout_s", "backoff_initial_s", "backoff_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.debounce_s < 0:
            raise ValueError(f"debounce_s must be >= 0, got {self.debounce_s}")
        if self.max_gather_s < self.debounce_s:
            raise ValueError(f"max_gather_s must be >= debounce_s, got {self.max_gather_s}")
        if not 1 <= self.max_concurrent_calls <= 256:
            raise ValueError(f"max_concurrent_calls must be in [1, 256], got {self.max_concurrent_calls}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")

    def backoff_s(self, num_failures: int) -> float:
        return min(self.backoff_initial_s * 2 ** max(num_failures - 1, 0), self.backoff_max_s)


@dataclass(frozen=True)
class ElectionSettings:
    """client-go's defaults (15 s / 10 s / 2 s) scaled by 2/3, so that a standby takes over within
    lease + 2 retries = 12 s of a leader's death; a leader that cannot renew stops 4 s before that."""

    lease_name: str
    namespace: str
    identity: str
    lease_duration_s: int = 10  # Lease.spec.leaseDurationSeconds is an integer
    renew_deadline_s: float = 6.0
    retry_period_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("lease_name", "namespace", "identity"):
            if not getattr(self, name):
                raise ValueError(f"leader election needs a non-empty {name}")
        if self.retry_period_s <= 0:
            raise ValueError(f"retry_period_s must be > 0, got {self.retry_period_s}")
        if self.renew_deadline_s <= 1.2 * self.retry_period_s:  # client-go's rule: a renewal may be retried
            raise ValueError(f"renew_deadline_s must be > 1.2 * retry_period_s, got {self.renew_deadline_s}")
        if int(self.lease_duration_s) != self.lease_duration_s or self.lease_duration_s <= self.renew_deadline_s:
            raise ValueError(f"lease_duration_s must be a whole number of seconds > renew_deadline_s, "
                             f"got {self.lease_duration_s}")


@dataclass(frozen=True)
class RunSettings:
    """How `kubelora operator` runs kopf: what it watches, its probe and metrics ports (None: off), its logging,
    and its leader election (None: it leads alone)."""

    namespaces: tuple[str, ...] = ()  # empty: the whole cluster
    liveness_port: int | None = None
    metrics_port: int | None = None
    is_verbose: bool = False
    election: ElectionSettings | None = None

    def __post_init__(self) -> None:
        for name in ("liveness_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port <= 65535:
                raise ValueError(f"{name} must be in [1, 65535], got {port}")


_setting = functools.partial(Setting, env_prefix=ENV_PREFIX)
DEFAULT_LEASE = "kubelora-operator"

# Each table fills one dataclass: a row's config_field (else its dest) names the field, and a row left unset keeps
# that field's default (docs/operator.md lists them; tests/test_operator/test_cli.py checks that it does).
RUN_SETTINGS: tuple[Setting, ...] = (
    _setting("--namespace", str, "watch this namespace (repeatable; comma-separated in the environment)",
             is_list=True, aliases=("-n",), env_name="NAMESPACES", config_field="namespaces"),
    _setting("--all-namespaces", parse_bool, "watch the whole cluster (the default without --namespace)",
             is_switch=True, aliases=("-A",)),
    _setting("--liveness", int, "serve kopf's liveness probe on http://0.0.0.0:PORT/healthz (default off)",
             env_name="LIVENESS_PORT", config_field="liveness_port"),
    _setting("--metrics-port", int, "serve Prometheus metrics on http://0.0.0.0:PORT/metrics (default off)"),
    _setting("--verbose", parse_bool, "kopf debug logging", is_switch=True, config_field="is_verbose"),
)
OPERATOR_SETTINGS: tuple[Setting, ...] = (
    _setting("--resync-seconds", float, "reconcile each pool at least this often",
             env_name="RESYNC_S", config_field="resync_s"),
    _setting("--max-concurrent-calls", int, "engine load/unload calls in flight per pool"),
    _setting("--engine-timeout-seconds", float, "one engine call", env_name="ENGINE_TIMEOUT_S",
             config_field="engine_timeout_s"),
    _setting("--backoff-initial-seconds", float, "first retry after a transient engine failure",
             env_name="BACKOFF_INITIAL_S", config_field="backoff_initial_s"),
    _setting("--backoff-max-seconds", float, "longest retry interval", env_name="BACKOFF_MAX_S",
             config_field="backoff_max_s"),
)
IMAGE_SETTINGS: tuple[Setting, ...] = (
    _setting("--engine-image", str, f"engine image of pools that name none (default {DefaultImages.engine})",
             config_field="engine"),
    _setting("--router-image", str, f"router image of pools that name none (default {DefaultImages.router})",
             config_field="router"),
)
NETWORK_POLICY_SETTINGS: tuple[Setting, ...] = (
    _setting("--network-policy", parse_bool, "create a NetworkPolicy per pool (default on)", is_switch=True,
             config_field="is_enabled"),
    _setting("--operator-pod-labels", NetworkPolicySettings.parse_labels, "K=V,...: labels of this operator's "
             "pods, the only peers the admin port admits (default app.kubernetes.io/component=operator)",
             env_name="POD_LABELS"),
    _setting("--operator-namespace", str, "this operator's namespace (default: env POD_NAMESPACE, else the "
             "service account's; unknown: pods with those labels in any namespace)", env_name="POD_NAMESPACE"),
)
ELECTION_SETTINGS: tuple[Setting, ...] = (
    _setting("--leader-elect", parse_bool, "run kopf only while holding a coordination.k8s.io Lease",
             is_switch=True),
    _setting("--leader-elect-lease", str, f"the Lease's name (default {DEFAULT_LEASE})", config_field="lease_name"),
    _setting("--leader-elect-namespace", str, "the Lease's namespace (default: env POD_NAMESPACE, else the "
             "service account's)", config_field="namespace"),
    _setting("--leader-elect-identity", str, "this replica's holder identity (default: env POD_NAME or the host "
             "name, plus a random suffix)", config_field="identity"),
    _setting("--leader-elect-lease-seconds", int, "leaseDurationSeconds", env_name="LEADER_ELECT_LEASE_S",
             config_field="lease_duration_s"),
    _setting("--leader-elect-renew-seconds", float, "a leader that could not renew this long stops",
             env_name="LEADER_ELECT_RENEW_S", config_field="renew_deadline_s"),
    _setting("--leader-elect-retry-seconds", float, "how often the leader renews and a standby tries",
             env_name="LEADER_ELECT_RETRY_S", config_field="retry_period_s"),
)
SETTINGS = RUN_SETTINGS + OPERATOR_SETTINGS + IMAGE_SETTINGS + NETWORK_POLICY_SETTINGS + ELECTION_SETTINGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, RUN_SETTINGS + OPERATOR_SETTINGS + IMAGE_SETTINGS)
    settings.add_arguments(parser.add_argument_group("engine NetworkPolicy (one per pool; docs/operator.md, closed "
                                                     "by default)"), NETWORK_POLICY_SETTINGS)
    settings.add_arguments(parser.add_argument_group("leader election (several replicas, one active)"),
                           ELECTION_SETTINGS)


def _given(table: tuple[Setting, ...], args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, object]:
    """The rows set by a flag or a variable, by field name; the others keep their dataclass's default."""
    values = {s.field_name: settings.given_value(s, args, environ, settings.env_value) for s in table}
    return {name: tuple(value) if isinstance(value, list) else value
            for name, value in values.items() if value is not None}


def resolve_operator(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """What the handlers get. Flags win over the environment, which wins over the defaults; ValueError names the
    setting."""
    environ = os.environ if environ is None else environ
    network = _given(NETWORK_POLICY_SETTINGS, args, environ)
    network.setdefault("operator_namespace", _own_namespace(environ) or "")
    return OperatorSettings(**_given(OPERATOR_SETTINGS, args, environ),
                            images=DefaultImages(**_given(IMAGE_SETTINGS, args, environ)),
                            network_policy=NetworkPolicySettings(**network))


def resolve_run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RunSettings:
    """How the process runs kopf, as resolve_operator."""
    environ = os.environ if environ is None else environ
    run = _given(RUN_SETTINGS, args, environ)
    if run.pop("all_namespaces", False) and run.get("namespaces"):
        raise ValueError("--all-namespaces and --namespace (KUBELORA_OPERATOR_NAMESPACES) exclude each other")
    return RunSettings(**run, election=_election(args, environ))


def _election(args: argparse.Namespace, environ: Mapping[str, str]) -> ElectionSettings | None:
    values = _given(ELECTION_SETTINGS, args, environ)
    if not values.pop("leader_elect", False):
        return None
    values.setdefault("lease_name", DEFAULT_LEASE)
    values.setdefault("namespace", _own_namespace(environ))
    if not values["namespace"]:
        raise ValueError("--leader-elect needs --leader-elect-namespace (or env POD_NAMESPACE) outside a pod")
    # As kube-controller-manager: the pod's name plus a random suffix, so that a restarted container is a new
    # candidate and never mistakes its dead predecessor's Lease for its own.
    values.setdefault("identity", f"{environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}")
    return ElectionSettings(**values)


def _own_namespace(environ: Mapping[str, str]) -> str | None:
    """env POD_NAMESPACE (the chart's downward API), else the service account's namespace; None outside a pod."""
    if environ.get("POD_NAMESPACE"):
        return environ["POD_NAMESPACE"]
    path = Path(SERVICE_ACCOUNT_NAMESPACE)
    if not path.is_file():
        return None
    return path.read_text().strip() or None
