"""An adapter source as open endpoints and logs may show it.

A `lora_path` may carry secrets: a presigned URL's signature in its query string, credentials in its userinfo.
`redact_source` keeps scheme, host, port and path; `source_digest` identifies the full text without showing it,
so a caller that knows the source (the operator) can still compare: `sha256:` + hex sha256 of its UTF-8 bytes.
"""

from __future__ import annotations

import hashlib
import urllib.parse

REDACTED = "<redacted>"


def redact_source(source: str) -> str:
    """`source` without userinfo, query or fragment; a local path is returned as given."""
    parts = urllib.parse.urlsplit(source)
    if not parts.scheme and not parts.netloc:
        return source
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        port = ""
    userinfo = f"{REDACTED}@" if "@" in parts.netloc else ""
    query = f"?{REDACTED}" if parts.query else ""
    fragment = f"#{REDACTED}" if parts.fragment else ""
    return f"{parts.scheme}://{userinfo}{host}{port}{parts.path}{query}{fragment}"


def source_digest(source: str) -> str:
    return "sha256:" + hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
