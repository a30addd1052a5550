"""Adapter sources in S3 or an S3-compatible server: `s3://bucket/key`, an archive object or a prefix holding
the adapter files.

The SDK only signs: obstore (the Python binding of the Rust `object_store` crate) turns the request's key pair,
or the default credential chain (environment, web identity token, container or instance metadata), into a
SigV4 presigned GET, and `downloads.download` fetches it with every limit an http(s) source has (deadline, size
cap, short reads). The signed URL carries the access key id and the signature in its query string: it is
never logged or shown (errors name the `s3://` source), and redirects are followed only to the signing host.

An adapter manifest must not make a pod read arbitrary buckets or reach arbitrary hosts: the bucket must be in
`allowed_buckets`, and an endpoint named by the request in `allowed_endpoints`. An endpoint from the pod's own
environment (`AWS_ENDPOINT_URL`, set by whoever deployed the engine) is trusted as the rest of its environment.
"""

from __future__ import annotations

import fnmatch
import re
import urllib.parse
from dataclasses import dataclass, field
from datetime import timedelta

from kubelora.engine.common.errors import AdapterSourceError

SIGNED_URL_TTL = timedelta(minutes=15)  # longer than no single download: the deadline ends those first
# S3 bucket naming rules (3..63 lowercase letters, digits, dots, hyphens; a letter or digit at each end).
BUCKET_RULE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class S3Access:
    """How to reach and sign for a bucket; from the load request (the operator reads it from a Secret)."""
    endpoint: str | None = None  # scheme://host[:port] of an S3-compatible server; None: AWS (or AWS_ENDPOINT_URL)
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
    access_key_id: str | None = field(default=None, repr=False)  # None (with no secret): the default chain
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("s3.access_key_id and s3.secret_access_key go together")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("s3.session_token needs s3.access_key_id and s3.secret_access_key")
        if self.endpoint is not None:
            normalize_endpoint(self.endpoint)  # raises ValueError naming the field
        if self.region is not None and not re.fullmatch(r"[a-z0-9-]{1,64}", self.region):
            raise ValueError(f"s3.region must be a region name such as us-east-1, got {self.region!r}")


@dataclass(frozen=True)
class S3Object:
    bucket: str
    key: str  # no leading slash; "" for the bucket's root


def normalize_endpoint(endpoint: str) -> str:
    """`scheme://host[:port]`, lowercased, without a trailing slash; ValueError for anything else."""
    parts = urllib.parse.urlsplit(endpoint.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or parts.username or parts.password \
            or parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"s3 endpoint must be http(s)://host[:port], got {endpoint!r}")
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        raise ValueError(f"s3 endpoint has a bad port: {endpoint!r}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme.lower()}://{host.lower()}{port}"


def _refuse(message: str, code: str = "url_not_allowed") -> AdapterSourceError:
    return AdapterSourceError(message, param="lora_path", code=code)


def parse_s3_url(source: str) -> S3Object:
    parts = urllib.parse.urlsplit(source)
    if "@" in parts.netloc:
        raise _refuse("s3 adapter URLs must not carry credentials; the load request's s3 fields do")
    if parts.query or parts.fragment or "?" in source or "#" in source:
        raise _refuse("s3 adapter URLs take no query or fragment")
    bucket = parts.netloc
    if not BUCKET_RULE.fullmatch(bucket):
        raise _refuse(f"s3 bucket {bucket!r} is not a valid bucket name (3..63 of a-z, 0-9, '.', '-')")
    key = parts.path.lstrip("/")
    if "\x00" in key or ".." in key.split("/"):
        raise _refuse("s3 keys must not contain '..' components")
    return S3Object(bucket, key)


def check_s3_allowed(obj: S3Object, access: S3Access, allowed_buckets: tuple[str, ...],
                     allowed_endpoints: tuple[str, ...]) -> None:
    """Bucket patterns as fnmatch (`team-*`); endpoints compared as normalized scheme://host[:port]."""
    if not any(fnmatch.fnmatchcase(obj.bucket, pattern) for pattern in allowed_buckets):
        raise _refuse(f"s3 bucket {obj.bucket!r} is not an allowed adapter bucket (--adapter-s3-bucket)")
    if access.endpoint is not None:
        endpoint = normalize_endpoint(access.endpoint)
        if endpoint not in {normalize_endpoint(e) for e in allowed_endpoints}:
            raise _refuse(f"s3 endpoint {endpoint!r} is not an allowed adapter endpoint (--adapter-s3-endpoint)")


def sign_get(obj: S3Object, access: S3Access, *, timeout_s: float) -> str:
    """A presigned GET URL for `obj`. Signing with the default chain may fetch credentials (STS for a web
    identity, instance metadata; `timeout_s` bounds the HTTP client's calls); a failure there is transient
    (the next try may get them)."""
    import obstore
    from obstore.store import S3Store

    options: dict = {"bucket": obj.bucket}
    if access.endpoint is not None:
        options["endpoint"] = normalize_endpoint(access.endpoint)
    if access.region is not None:
        options["region"] = access.region
    if access.access_key_id is not None:
        options.update(access_key_id=access.access_key_id, secret_access_key=access.secret_access_key)
        if access.session_token is not None:
            options["session_token"] = access.session_token
    timeout = timedelta(seconds=timeout_s)
    try:
        store = S3Store(**options, client_options={"allow_http": True, "connect_timeout": timeout,
                                                   "timeout": timeout})
        return obstore.sign(store, "GET", obj.key, SIGNED_URL_TTL)
    except Exception as exc:  # obstore raises its own BaseError family and ValueError for bad options
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AdapterSourceError(f"cannot sign a request for s3://{obj.bucket}/{obj.key}: {first_line}",
                                 param="lora_path", code="s3_credentials", is_transient=True) from None
