"""Checks of a LoRAAdapter against its pool that need no engine: rank, targets, source confinement.

The engine repeats them (and checks what only the files tell: real rank, shapes, base model); checking here
first gives a clear reason without touching any pod, and keeps a bad manifest from reaching a pod at all.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from urllib.parse import urlsplit

from kubelora.operator.specs import AdapterSpec, InvalidSpec, PoolSpec
from kubelora.operator.status import Failure

SUPPORTED_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def validate_adapter(adapter: AdapterSpec, pool: PoolSpec) -> None:
    """Raise InvalidSpec (with a CamelCase reason) when `adapter` cannot be served by `pool`."""
    if adapter.rank is not None and adapter.rank > pool.engine.max_lora_rank:
        raise InvalidSpec("RankTooHigh", f"spec.rank {adapter.rank} exceeds the pool's engine.maxLoraRank "
                                         f"{pool.engine.max_lora_rank}")
    unsupported = sorted(set(adapter.targets) - SUPPORTED_TARGETS)
    if unsupported:
        raise InvalidSpec("TargetUnsupported", f"spec.targets {unsupported} are not supported; allowed: "
                                               f"{sorted(SUPPORTED_TARGETS)}")
    if adapter.source.path is not None:
        check_path_allowed(adapter.source.path, pool.adapter_roots)
    elif adapter.source.is_s3:
        check_s3_allowed(adapter.source.url or "", adapter.source.s3_endpoint, pool.adapter_s3_buckets,
                         pool.adapter_s3_endpoints)
    else:
        check_url_allowed(adapter.source.url or "", pool.adapter_url_hosts)


RANK_MISMATCH, TARGETS_MISMATCH = "RankMismatch", "TargetsMismatch"
DECLARED_MISMATCHES = frozenset({RANK_MISMATCH, TARGETS_MISMATCH})


def check_declared(name: str, declared_rank: int | None, declared_targets: tuple[str, ...], rank: int | None,
                   targets: tuple[str, ...] | None, where: str) -> Failure | None:
    """A declared spec.rank or spec.targets that the adapter files (as the engine read them) contradict.

    The engine reports each adapter's rank (its largest module rank) and the modules it adapts; what it does not
    report is not checked. `where` names the pod that reported it."""
    if declared_rank is not None and rank is not None and declared_rank != rank:
        return Failure(RANK_MISMATCH, f"spec.rank is {declared_rank} but the files of {name!r} have rank {rank} "
                                      f"({where})")
    if declared_targets and targets is not None and set(declared_targets) != set(targets):
        return Failure(TARGETS_MISMATCH, f"spec.targets is {sorted(declared_targets)} but the files of {name!r} "
                                         f"adapt {sorted(targets)} ({where})")
    return None


def check_path_allowed(path: str, roots: tuple[str, ...]) -> None:
    """Bare absolute paths, `file://` paths and paths relative to a root, confined to the roots lexically.

    The engine resolves symlinks as well; this check only has the manifest to go by.
    """
    if not roots:
        raise InvalidSpec("PathNotAllowed", "spec.source.path needs the pool to list spec.adapterRoots")
    local = path[len("file://"):] if path.startswith("file://") else path
    if ".." in local.split("/"):
        raise InvalidSpec("PathNotAllowed", f"spec.source.path {path!r} must not contain '..'")
    if not local.startswith("/"):
        return  # relative paths are resolved under each root by the engine
    normalized = posixpath.normpath(local)
    for root in roots:
        root_norm = posixpath.normpath(root)
        if normalized == root_norm or normalized.startswith(root_norm.rstrip("/") + "/"):
            return
    raise InvalidSpec("PathNotAllowed", f"spec.source.path {path!r} is not under the pool's adapterRoots "
                                        f"{list(roots)}")


def check_url_allowed(url: str, hosts: tuple[str, ...]) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidSpec("UrlNotAllowed", f"spec.source.url {url!r} must be an http(s) URL")
    if parts.username or parts.password:
        raise InvalidSpec("UrlNotAllowed", "spec.source.url must not carry credentials")
    if not any(host_matches(parts.hostname, parts.port, pattern) for pattern in hosts):
        raise InvalidSpec("UrlNotAllowed", f"spec.source.url host {parts.hostname!r} is not in the pool's "
                                           f"adapterUrlHosts {list(hosts)}")


S3_BUCKET_RULE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # as the engine's s3.BUCKET_RULE


def check_s3_allowed(url: str, endpoint: str | None, buckets: tuple[str, ...], endpoints: tuple[str, ...]) -> None:
    """An s3://bucket/key url: a valid bucket the pool's adapterS3Buckets allow; a spec.source.s3.endpoint in
    its adapterS3Endpoints. (An endpoint from the Secret is known only to the pass that reads it: the engine
    checks that one against the same list, rendered as --adapter-s3-endpoint.)"""
    parts = urlsplit(url)
    if "@" in parts.netloc or parts.query or parts.fragment or "?" in url or "#" in url:
        raise InvalidSpec("UrlNotAllowed", "spec.source.url: s3 urls carry no credentials, query or fragment")
    if not S3_BUCKET_RULE.fullmatch(parts.netloc):
        raise InvalidSpec("UrlNotAllowed", f"spec.source.url bucket {parts.netloc!r} is not a valid S3 bucket name")
    if ".." in parts.path.split("/"):
        raise InvalidSpec("UrlNotAllowed", f"spec.source.url {url!r} must not contain '..'")
    if not any(fnmatch.fnmatchcase(parts.netloc, pattern) for pattern in buckets):
        raise InvalidSpec("UrlNotAllowed", f"spec.source.url bucket {parts.netloc!r} is not in the pool's "
                                           f"adapterS3Buckets {list(buckets)}")
    if endpoint is not None and normalize_endpoint(endpoint) not in {normalize_endpoint(e) for e in endpoints}:
        raise InvalidSpec("UrlNotAllowed", f"spec.source.s3.endpoint {endpoint!r} is not in the pool's "
                                           f"adapterS3Endpoints {list(endpoints)}")


def normalize_endpoint(endpoint: str) -> str:
    """scheme://host[:port] lowercased, no trailing slash: the form endpoints are compared in."""
    return endpoint.strip().rstrip("/").lower()


def host_matches(host: str, port: int | None, pattern: str) -> bool:
    """`host` (any port), `host:port` or `*.example.com`, as the engine's --adapter-url-host."""
    pattern_host, _, pattern_port = pattern.partition(":")
    if pattern_port and str(port) != pattern_port:
        return False
    return fnmatch.fnmatchcase(host.lower(), pattern_host.lower())
