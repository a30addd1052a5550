"""Adapter sources in S3 or an S3-compatible server: `s3://bucket/key`, an archive object or a prefix holding
the adapter files.

The SDK only signs: obstore (the Python binding of the Rust `object_store` crate) turns the request's key pair,
or the default credential chain (environment, web identity token, container or instance metadata), into a
SigV4 presigned GET, and `downloads.download` fetches it with every limit an http(s) source has (deadline, size
cap, short reads). The signed URL carries the access key id and the signature in its query string: it is
never logged or shown (errors name the `s3://` source), and redirects are followed only to the signing host.

Which buckets and endpoints a load may name is `kubelora.contract.sources` (checked before anything is signed).
An endpoint from the pod's own environment (`AWS_ENDPOINT_URL`, set by whoever deployed the engine) is trusted as
the rest of its environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from kubelora.contract.errors import AdapterSourceError
from kubelora.contract.load import S3Access
from kubelora.contract.sources import normalize_endpoint

SIGNED_URL_TTL = timedelta(minutes=15)  # longer than no single download: the deadline ends those first


@dataclass(frozen=True)
class S3Object:
    bucket: str
    key: str  # no leading slash; "" for the bucket's root


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
