"""API coordinates, labels and the names of the objects the operator owns for a pool."""

from __future__ import annotations

GROUP = "kubelora.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
POOL_PLURAL = "lorapools"
ADAPTER_PLURAL = "loraadapters"

ENGINE_PORT = 8000  # the engine's serving port: OpenAI API, public model list, probes, metrics
ENGINE_ADMIN_PORT = 8001  # the engine's admin port: load/unload and the full model list (docs/server.md)
ROUTER_PORT = 8080
FIELD_MANAGER = "kubelora-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_POOL = "kubelora.io/pool"
MANAGED_BY = "kubelora-operator"
# On engine pods: the digest of the pool spec they were made from (specs.pool_fingerprint). A refusal by a pod
# made from an older spec is not permanent: a rollout is replacing that pod.
ANNOTATION_POOL_SPEC = "kubelora.io/pool-spec"
# On the engine pod template: a digest of the admin token the pods read at start; a new token rolls them.
ANNOTATION_ADMIN_TOKEN = "kubelora.io/admin-token-digest"
# On LoRAAdapters, set by users: a new value retries a Failed adapter once and cuts short a transient backoff.
ANNOTATION_RETRY = "kubelora.io/retry"


def retry_request(body: dict) -> str:
    """The adapter's kubelora.io/retry annotation ("" when absent)."""
    return str((body["metadata"].get("annotations") or {}).get(ANNOTATION_RETRY, ""))


def engine_name(pool: str) -> str:
    return f"{pool}-engine"


def router_name(pool: str) -> str:
    return f"{pool}-router"


def placement_configmap_name(pool: str) -> str:
    return f"{pool}-placement"


def admin_token_secret_name(pool: str) -> str:
    """The Secret holding the pool's engine admin token, when the pool names none (key ADMIN_TOKEN_KEY)."""
    return f"{pool}-engine-admin"


ADMIN_TOKEN_KEY = "token"
# In a generated admin token Secret, the tokens that engine pods of the pool still ran with when the operator
# made it (a rotation): key PREVIOUS_TOKEN_PREFIX + the token's digest, so a restarted operator still reads them.
PREVIOUS_TOKEN_PREFIX = "previous-"


def network_policy_name(pool: str) -> str:
    return f"{pool}-engine"


def pool_labels(pool: str, component: str) -> dict[str, str]:
    return {LABEL_NAME: "kubelora", LABEL_COMPONENT: component, LABEL_POOL: pool, LABEL_MANAGED_BY: MANAGED_BY}


def engine_selector(pool: str) -> dict[str, str]:
    """Labels that select a pool's engine pods (immutable in the Deployment: never change them)."""
    return {LABEL_POOL: pool, LABEL_COMPONENT: "engine"}


def router_selector(pool: str) -> dict[str, str]:
    """Labels that select a pool's router pods."""
    return {LABEL_POOL: pool, LABEL_COMPONENT: "router"}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
