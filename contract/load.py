"""The engine's adapter load request (`POST /v1/load_lora_adapter` on the admin port): the operator builds it
(`LoadRequest.as_payload`), the engine parses the same fields back (`kubelora.engine.server.protocol`).

The vLLM fields (`lora_name`, `lora_path`, `load_inplace`) plus kubelora's: `preload`, `sha256`, `auth_token` (a
bearer token for an http(s) source's host) and `s3` (endpoint, region and key pair of an s3:// source).
Credentials are never logged nor shown: they are left out of every repr.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from kubelora.contract.sources import normalize_endpoint

# The keys an s3 source's credentials are read from: named as the AWS SDKs' environment variables, so that
# `kubectl create secret generic NAME --from-env-file=...` takes the same file. Only the key pair is required.
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                  "AWS_REGION")
S3_FIELDS = ("endpoint", "region", "access_key_id", "secret_access_key", "session_token")
_SECRET_FIELDS = ("access_key_id", "secret_access_key", "session_token", "endpoint", "region")  # as S3_SECRET_KEYS
REGION_RULE = re.compile(r"[a-z0-9-]{1,64}")


@dataclass(frozen=True)
class S3Access:
    """How to reach and sign for a bucket. No key pair: the engine's default credential chain."""
    endpoint: str | None = None  # scheme://host[:port] of an S3-compatible server; None: AWS (or AWS_ENDPOINT_URL)
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("s3.access_key_id and s3.secret_access_key go together")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("s3.session_token needs s3.access_key_id and s3.secret_access_key")
        if self.endpoint is not None:
            normalize_endpoint(self.endpoint)  # raises ValueError naming the field
        if self.region is not None and not REGION_RULE.fullmatch(self.region):
            raise ValueError(f"s3.region must be a region name such as us-east-1, got {self.region!r}")

    @classmethod
    def from_secret_data(cls, data: dict[str, str]) -> S3Access | None:
        """From a Secret's S3_SECRET_KEYS; None when the key pair is not both there or a value is malformed."""
        values = {name: data.get(key) or None for name, key in zip(_SECRET_FIELDS, S3_SECRET_KEYS)}
        if values["access_key_id"] is None or values["secret_access_key"] is None:
            return None
        try:
            return cls(**values)
        except ValueError:
            return None

    def overridden(self, endpoint: str | None, region: str | None) -> S3Access:
        """These endpoint and region where given, this access's otherwise."""
        return replace(self, endpoint=endpoint or self.endpoint, region=region or self.region)

    def as_payload(self) -> dict[str, str]:
        """The load request's `s3` field."""
        return {name: getattr(self, name) for name in S3_FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True)
class LoadRequest:
    lora_name: str
    lora_path: str
    is_inplace: bool = False
    is_preload: bool = True
    sha256: str | None = None  # lowercase hex of the weights file (or the archive)
    auth_token: str | None = field(default=None, repr=False)
    s3: S3Access | None = field(default=None, repr=False)

    def as_payload(self) -> dict:
        """The JSON body; optional fields only when set."""
        payload = {"lora_name": self.lora_name, "lora_path": self.lora_path, "load_inplace": self.is_inplace,
                   "preload": self.is_preload}
        if self.sha256:
            payload["sha256"] = self.sha256
        if self.auth_token:
            payload["auth_token"] = self.auth_token
        if self.s3 is not None:
            payload["s3"] = self.s3.as_payload()
        return payload
