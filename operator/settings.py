"""The operator's own settings (flags and KUBELORA_OPERATOR_* env, parsed in cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata


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
