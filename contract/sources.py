"""Which adapter sources a pool allows: the rules the operator checks at admission and the engine checks again at
load, from the manifest's text alone (no I/O).

A source (`lora_path`) is one of:
- a local path, bare or `file://` (host empty or `localhost`): no NUL and no `..` component; a relative path
  is looked up under each root; an absolute one must lie under a root, compared after normalising both
  (`posixpath.normpath`). The engine then resolves symlinks, and checks that the directory and every entry in
  it stay under that root: only it sees the files.
- an `http://` or `https://` URL without credentials whose host matches an allowed host pattern;
- an `s3://bucket/key` URL: a valid bucket name (`BUCKET_RULE`) matching an allowed bucket pattern (fnmatch,
  `team-*`), no credentials, query, fragment or `..` key component; an endpoint the load names must be one of
  the allowed endpoints, both compared as `normalize_endpoint` gives them.

Host patterns: a hostname glob with an optional `:port` (`models.example.com`, `*.example.com:443`,
`[::1]:8080`). The host is compared label by label, case-insensitively, with as many labels on both sides;
in a pattern label `*` matches any run of characters within one label, so `*.example.com` matches
`a.example.com` but neither `example.com` nor `a.b.example.com`. A pattern without a port allows every port;
with one, the URL's port must equal it, the URL's default port (80 for http, 443 for https) filled in first.
The engine applies the same test to every redirect of a download.
"""

from __future__ import annotations

import enum
import fnmatch
import posixpath
import re
import urllib.parse
from dataclasses import dataclass

from kubelora.contract.errors import AdapterSourceError

# S3 bucket naming rules (3..63 lowercase letters, digits, dots, hyphens; a letter or digit at each end).
BUCKET_RULE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
DEFAULT_PORTS = {"http": 80, "https": 443}


class SourceNotAllowed(AdapterSourceError):
    """A source the rules refuse, never transient. `rule`: the `SourceRules` field that would have to allow it;
    None when none could (credentials in the URL, a `..` component, a malformed bucket name)."""

    def __init__(self, message: str, *, code: str, rule: str | None, param: str = "lora_path") -> None:
        super().__init__(message, param=param, code=code)
        self.rule = rule


class SourceKind(enum.Enum):
    LOCAL = "local"
    URL = "url"  # http(s)
    S3 = "s3"


@dataclass(frozen=True)
class SourceRules:
    """What a pool allows (spec.adapterRoots, adapterUrlHosts, adapterS3Buckets, adapterS3Endpoints; the
    engine's --adapter-root, --adapter-url-host, --adapter-s3-bucket, --adapter-s3-endpoint)."""
    roots: tuple[str, ...] = ()
    url_hosts: tuple[str, ...] = ()
    s3_buckets: tuple[str, ...] = ()
    s3_endpoints: tuple[str, ...] = ()


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    text: str  # the source as the load names it
    bucket: str = ""  # S3
    key: str = ""  # S3: no leading slash; "" for the bucket's root


def source_kind(lora_path: str) -> SourceKind:
    scheme = urllib.parse.urlsplit(lora_path).scheme.lower()
    if scheme in DEFAULT_PORTS:
        return SourceKind.URL
    if scheme == "s3":
        return SourceKind.S3
    if scheme in ("", "file"):
        return SourceKind.LOCAL
    raise _refuse(f"lora_path scheme {scheme!r} is not supported; use a path, file://, http://, https:// or s3://",
                  "unsupported_scheme")


def check_source(rules: SourceRules, lora_path: str, *, s3_endpoint: str | None = None) -> Source:
    """The source, parsed, when `rules` allow it; else SourceNotAllowed (`code`: path_not_allowed,
    url_not_allowed or unsupported_scheme; never transient: only a new spec or new rules change the answer)."""
    kind = source_kind(lora_path)
    if kind is SourceKind.LOCAL:
        check_local(rules.roots, lora_path)
        return Source(kind, lora_path)
    if kind is SourceKind.URL:
        check_url(rules.url_hosts, lora_path)
        return Source(kind, lora_path)
    bucket, key = parse_s3_url(lora_path)
    check_s3(rules, bucket, s3_endpoint)
    return Source(kind, lora_path, bucket=bucket, key=key)


def check_local(roots: tuple[str, ...], lora_path: str) -> str:
    """The local path of a bare or `file://` source, when it stays under a root lexically."""
    if not roots:
        raise _refuse("local adapter paths are disabled: no adapter roots are configured", rule="roots")
    text = lora_path
    if lora_path[:5].lower() == "file:":
        parts = urllib.parse.urlsplit(lora_path)
        if parts.netloc not in ("", "localhost"):
            raise _refuse(f"file URL must name a local path, got host {parts.netloc!r}")
        text = urllib.parse.unquote(parts.path)
    if "\x00" in text or ".." in text.split("/"):
        raise _refuse(f"lora_path {lora_path!r} must not contain '..' components")
    if not text.startswith("/"):
        return text  # looked up under each root
    normalized = posixpath.normpath(text)
    for root in roots:
        root_norm = posixpath.normpath(root)
        if normalized == root_norm or normalized.startswith(root_norm.rstrip("/") + "/"):
            return text
    raise _refuse(f"lora_path {lora_path!r} is outside the adapter roots {list(roots)}", rule="roots")


def check_url(patterns: tuple[str, ...], url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password:
        raise _refuse("adapter URLs must not carry credentials", "url_not_allowed")
    if not host_allowed(patterns, url):
        raise _refuse(f"host {parts.netloc!r} is not an allowed adapter host {list(patterns)}", "url_not_allowed",
                      rule="url_hosts")


def host_allowed(patterns: tuple[str, ...], url: str) -> bool:
    """Whether an http(s) URL's host and port match one of `patterns` (the module docstring's semantics)."""
    parts = urllib.parse.urlsplit(url)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in DEFAULT_PORTS or not host:
        return False
    try:
        port = parts.port or DEFAULT_PORTS[scheme]
    except ValueError:
        return False
    return any(_host_matches(host, port, pattern) for pattern in patterns)


def check_host_pattern(pattern: str) -> None:
    """ValueError naming the pattern unless it is a host glob with an optional numeric port."""
    if _split_pattern(pattern) is None:
        raise ValueError(f"adapter URL host pattern must be host[:port] (a glob host), got {pattern!r}")


def _split_pattern(pattern: str) -> tuple[str, int | None] | None:
    parts = urllib.parse.urlsplit("//" + pattern.strip())
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.username or parts.password or parts.path or parts.query or parts.fragment:
        return None
    return parts.hostname.lower(), port


def _host_matches(host: str, port: int, pattern: str) -> bool:
    split = _split_pattern(pattern)
    if split is None:
        return False
    pattern_host, pattern_port = split
    if pattern_port is not None and pattern_port != port:
        return False
    labels, pattern_labels = host.split("."), pattern_host.split(".")
    return len(labels) == len(pattern_labels) and all(
        re.fullmatch(re.escape(want).replace(r"\*", ".*"), label) for label, want in zip(labels, pattern_labels))


def parse_s3_url(source: str) -> tuple[str, str]:
    """(bucket, key) of an `s3://bucket/key` source."""
    parts = urllib.parse.urlsplit(source)
    if "@" in parts.netloc:
        raise _refuse("s3 adapter URLs must not carry credentials; the load request's s3 fields do", "url_not_allowed")
    if parts.query or parts.fragment or "?" in source or "#" in source:
        raise _refuse("s3 adapter URLs take no query or fragment", "url_not_allowed")
    if not BUCKET_RULE.fullmatch(parts.netloc):
        raise _refuse(f"s3 bucket {parts.netloc!r} is not a valid bucket name (3..63 of a-z, 0-9, '.', '-')",
                      "url_not_allowed")
    key = parts.path.lstrip("/")
    if "\x00" in key or ".." in key.split("/"):
        raise _refuse("s3 keys must not contain '..' components", "url_not_allowed")
    return parts.netloc, key


def check_s3(rules: SourceRules, bucket: str, endpoint: str | None) -> None:
    if not any(fnmatch.fnmatchcase(bucket, pattern) for pattern in rules.s3_buckets):
        raise _refuse(f"s3 bucket {bucket!r} is not an allowed adapter bucket {list(rules.s3_buckets)}",
                      "url_not_allowed", rule="s3_buckets")
    if endpoint is None:
        return
    try:
        normalized = normalize_endpoint(endpoint)
    except ValueError as exc:
        raise _refuse(str(exc), "url_not_allowed", param="s3.endpoint") from None
    if normalized not in {_normalize_or_none(e) for e in rules.s3_endpoints}:
        raise _refuse(f"s3 endpoint {normalized!r} is not an allowed adapter endpoint {list(rules.s3_endpoints)}",
                      "url_not_allowed", rule="s3_endpoints", param="s3.endpoint")


def normalize_endpoint(endpoint: str) -> str:
    """`scheme://host[:port]`, lowercased, without a trailing slash; ValueError for anything else."""
    parts = urllib.parse.urlsplit(endpoint.strip())
    if parts.scheme.lower() not in DEFAULT_PORTS or not parts.hostname or parts.username or parts.password \
            or parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"s3 endpoint must be http(s)://host[:port], got {endpoint!r}")
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        raise ValueError(f"s3 endpoint has a bad port: {endpoint!r}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme.lower()}://{host.lower()}{port}"


def _normalize_or_none(endpoint: str) -> str | None:
    try:
        return normalize_endpoint(endpoint)
    except ValueError:
        return None  # a malformed allowed entry allows nothing


def _refuse(message: str, code: str = "path_not_allowed", *, rule: str | None = None,
            param: str = "lora_path") -> SourceNotAllowed:
    return SourceNotAllowed(message, code=code, rule=rule, param=param)
