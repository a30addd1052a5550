"""Typed views of the LoRAPool and LoRAAdapter specs (defaults as in crds/), parsed once at the edge.

The API server applies the CRD defaults; the same defaults here keep the pure functions usable on
partial specs (tests, objects created before a default existed).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kubelora.contract.errors import AdapterSourceError
from kubelora.contract.sources import SourceKind, source_kind
from kubelora.operator import names
from kubelora.operator.demand import Bounds

ALL_REPLICAS = "all"
AUTO_REPLICAS = "auto"  # copies sized by measured demand within minReplicas..maxReplicas (demand.py)


class InvalidSpec(ValueError):
    """A spec that no retry can fix; `reason` is the CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Volume:
    mount_path: str
    host_path: str | None = None
    claim_name: str | None = None
    is_read_only: bool = True

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | None) -> Volume | None:
        if not spec:
            return None
        return cls(mount_path=spec["mountPath"], host_path=spec.get("hostPath"), claim_name=spec.get("claimName"),
                   is_read_only=spec.get("readOnly", True))


@dataclass(frozen=True)
class EngineSettings:
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 8
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    device: str = "cuda"
    dtype: str | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_cpu_loras < self.max_loras:
            raise InvalidSpec("InvalidSpec", f"spec.engine.maxCpuLoras ({self.max_cpu_loras}) must be >= "
                                             f"spec.engine.maxLoras ({self.max_loras})")


@dataclass(frozen=True)
class RouterSettings:
    is_enabled: bool = False
    replicas: int = 1
    image: str | None = None  # None: the operator's default (OperatorSettings.images)


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str = "token"


@dataclass(frozen=True)
class PoolSpec:
    name: str
    namespace: str
    model_path: str
    served_name: str
    replicas: int = 1
    image: str | None = None  # None: the operator's default (OperatorSettings.images)
    image_pull_policy: str | None = None
    engine: EngineSettings = EngineSettings()
    model_volume: Volume | None = None
    adapter_volume: Volume | None = None
    resources: dict[str, Any] = field(default_factory=dict)
    adapter_roots: tuple[str, ...] = ()
    adapter_url_hosts: tuple[str, ...] = ()
    adapter_s3_buckets: tuple[str, ...] = ()  # bucket patterns s3:// sources may name; none refuses them
    adapter_s3_endpoints: tuple[str, ...] = ()  # http(s)://host[:port] an s3 source may name as its endpoint
    # The engine admin token: spec.adminTokenSecretRef, else the Secret the operator creates for the pool
    # (names.admin_token_secret_name; is_admin_token_managed). None only in specs built by hand (tests).
    admin_token: SecretRef | None = None
    is_admin_token_managed: bool = False
    allowed_client_namespaces: tuple[str, ...] = ()  # besides the pool's routers, these reach the serving port
    require_api_keys: bool = False  # spec.apiKeys.required: tenants call with keys of the pool's key Secrets
    router: RouterSettings = RouterSettings()
    pod_labels: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    fingerprint: str = ""  # pool_fingerprint of the body: what the engine pods' checks depend on

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PoolSpec:
        meta, spec = body["metadata"], body.get("spec") or {}
        model = spec.get("model") or {}
        if not model.get("path"):
            raise InvalidSpec("InvalidSpec", "spec.model.path is required")
        engine, router = spec.get("engine") or {}, spec.get("router") or {}
        token = spec.get("adminTokenSecretRef")
        return cls(
            name=meta["name"], namespace=meta["namespace"], model_path=model["path"],
            served_name=model.get("servedName") or model["path"].rstrip("/").rsplit("/", 1)[-1],
            replicas=int(spec.get("replicas", 1)), image=spec.get("image") or None,
            image_pull_policy=spec.get("imagePullPolicy"),
            engine=EngineSettings(
                max_loras=engine.get("maxLoras", 4), max_lora_rank=engine.get("maxLoraRank", 16),
                max_cpu_loras=engine.get("maxCpuLoras", 8), max_model_len=engine.get("maxModelLen", 2048),
                max_num_seqs=engine.get("maxNumSeqs"), device=engine.get("device", "cuda"),
                dtype=engine.get("dtype"), extra_args=tuple(engine.get("extraArgs") or ())),
            model_volume=Volume.from_spec(spec.get("modelVolume")),
            adapter_volume=Volume.from_spec(spec.get("adapterVolume")),
            resources=dict(spec.get("resources") or {}),
            adapter_roots=tuple(spec.get("adapterRoots") or ()),
            adapter_url_hosts=tuple(spec.get("adapterUrlHosts") or ()),
            adapter_s3_buckets=tuple(spec.get("adapterS3Buckets") or ()),
            adapter_s3_endpoints=tuple(spec.get("adapterS3Endpoints") or ()),
            admin_token=(SecretRef(token["name"], token.get("key", "token")) if token else
                         SecretRef(names.admin_token_secret_name(meta["name"]), names.ADMIN_TOKEN_KEY)),
            is_admin_token_managed=not token,
            allowed_client_namespaces=tuple(spec.get("allowedClientNamespaces") or ()),
            require_api_keys=bool((spec.get("apiKeys") or {}).get("required", False)),
            router=RouterSettings(is_enabled=router.get("enabled", False), replicas=router.get("replicas", 1),
                                  image=router.get("image") or None),
            pod_labels=dict(spec.get("podLabels") or {}), node_selector=dict(spec.get("nodeSelector") or {}),
            tolerations=tuple(spec.get("tolerations") or ()), fingerprint=pool_fingerprint(body),
        )


@dataclass(frozen=True)
class AdapterSource:
    path: str | None = None
    url: str | None = None
    sha256: str | None = None
    # http(s) url: a bearer token for its host; s3:// url: the Secret's S3_SECRET_KEYS (the key is not used).
    auth_secret: SecretRef | None = None
    s3_endpoint: str | None = None  # spec.source.s3.endpoint: an S3-compatible server (else the Secret's, or AWS)
    s3_region: str | None = None  # spec.source.s3.region

    def __post_init__(self) -> None:
        if (self.path is None) == (self.url is None):
            raise InvalidSpec("InvalidSpec", "spec.source needs exactly one of path and url")
        if self.auth_secret is not None and self.url is None:
            raise InvalidSpec("InvalidSpec", "spec.source.authSecretRef is for url sources only")
        if (self.s3_endpoint is not None or self.s3_region is not None) and not self.is_s3:
            raise InvalidSpec("InvalidSpec", "spec.source.s3 is for s3:// urls only")

    @property
    def is_s3(self) -> bool:
        return self.url is not None and _kind(self.url) is SourceKind.S3

    @property
    def lora_path(self) -> str:
        """What the engine's load call takes as `lora_path` (and reports back as `source`)."""
        return self.path if self.path is not None else self.url  # type: ignore[return-value]

    @property
    def revision(self) -> str:
        """A change of path, url, sha256 or credentials reference is a new revision; 10 hex digits of a hash.

        (The Secret's value is not part of it: a rotated token serves the same artifact.)
        """
        fields = {"path": self.path, "url": self.url, "sha256": self.sha256}
        if self.auth_secret is not None:  # absent otherwise, so revisions of older specs do not change
            fields["auth"] = [self.auth_secret.name, self.auth_secret.key]
        if self.s3_endpoint is not None or self.s3_region is not None:  # likewise
            fields["s3"] = [self.s3_endpoint, self.s3_region]
        canonical = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    namespace: str
    pool: str
    source: AdapterSource
    replicas: int | None = 1  # None: "all"
    auto: Bounds | None = None  # replicas "auto": its bounds (replicas is then the lower one)
    rank: int | None = None
    targets: tuple[str, ...] = ()
    generation: int = 0
    uid: str = ""

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 1:
            raise InvalidSpec("InvalidSpec", f"spec.replicas must be >= 1, \"all\" or \"auto\", got {self.replicas}")
        bounds = self.auto
        if bounds is not None and (bounds.min_replicas < 1 or (bounds.max_replicas is not None
                                                               and bounds.max_replicas < bounds.min_replicas)):
            raise InvalidSpec("InvalidSpec", f"spec.minReplicas must be >= 1 and spec.maxReplicas >= minReplicas, got "
                                             f"{bounds.min_replicas} and {bounds.max_replicas}")

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> AdapterSpec:
        meta, spec = body["metadata"], body.get("spec") or {}
        source = spec.get("source") or {}
        s3 = source.get("s3") or {}
        auto = None
        if spec.get("replicas") == AUTO_REPLICAS:
            auto = Bounds(_whole(spec.get("minReplicas", 1), "minReplicas"),
                          None if spec.get("maxReplicas") is None else _whole(spec["maxReplicas"], "maxReplicas"))
        return cls(
            name=meta["name"], namespace=meta["namespace"], pool=spec.get("pool", ""),
            source=AdapterSource(path=source.get("path"), url=source.get("url"), sha256=source.get("sha256"),
                                 auth_secret=_secret_ref(source.get("authSecretRef")),
                                 s3_endpoint=s3.get("endpoint") or None, s3_region=s3.get("region") or None),
            replicas=auto.min_replicas if auto else parse_replicas(spec.get("replicas", 1)), auto=auto,
            rank=spec.get("rank"),
            targets=tuple(spec.get("targets") or ()), generation=int(meta.get("generation") or 0),
            uid=meta.get("uid", ""),
        )


def _kind(lora_path: str) -> SourceKind | None:
    try:
        return source_kind(lora_path)
    except AdapterSourceError:
        return None


def _secret_ref(value: dict | None) -> SecretRef | None:
    return SecretRef(value["name"], value.get("key", "token")) if value else None


def _whole(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidSpec("InvalidSpec", f"spec.{name} must be an integer, got {value!r}")
    return value


def parse_replicas(value: int | str) -> int | None:
    """`replicas` is an int-or-string: an integer (also as a digit string) or "all" (None)."""
    if value == ALL_REPLICAS:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidSpec("InvalidSpec", f"spec.replicas must be an integer >= 1, \"all\" or \"auto\", got "
                          f"{value!r}") from None


# Pool fields that do not change what an engine accepts: scaling or toggling the router retries nothing.
_FINGERPRINT_EXCLUDED = ("replicas", "router")


def pool_fingerprint(body: dict) -> str:
    """A short digest of the pool spec an engine's adapter checks depend on (all but replicas and router)."""
    spec = {k: v for k, v in (body.get("spec") or {}).items() if k not in _FINGERPRINT_EXCLUDED}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
