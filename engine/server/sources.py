"""Where an adapter's files come from: a local directory under an `--adapter-root`, an http(s) URL on an
allowed host, or an `s3://` object or prefix in an allowed bucket (`s3.py`), downloaded into the cache directory.

An adapter manifest must not make a pod read arbitrary files or reach arbitrary hosts (DESIGN "Sources of
adapters"): the rules are `kubelora.contract.sources`, the operator's too; here local paths are also resolved
(symlinks included) and must stay under a root, every file inside the adapter directory too, and every redirect
of a download must go to an allowed host. Everything here blocks on I/O, so
callers run it in an executor, never on the event loop or the engine thread.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kubelora.contract.errors import AdapterSourceError
from kubelora.contract.load import S3Access
from kubelora.contract.sources import (Source, SourceKind, SourceNotAllowed, SourceRules, check_local, check_source, check_url,
                                       host_allowed, source_kind)
from kubelora.engine.server.archives import ARCHIVE_SUFFIXES, extract_archive, find_adapter_dir
from kubelora.engine.server.downloads import download
from kubelora.engine.server.s3 import S3Object, sign_get

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class SourceConfig:
    roots: tuple[Path, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    allowed_s3_buckets: tuple[str, ...] = ()  # fnmatch patterns; none refuses s3:// sources
    allowed_s3_endpoints: tuple[str, ...] = ()  # http(s)://host[:port] a load request may name as its endpoint
    cache_dir: Path = Path("/tmp/kubelora-adapters")
    max_bytes: int = 2 << 30
    timeout_s: float = 60.0  # per socket read
    deadline_s: float = 600.0  # per adapter: every file, redirect and read of its download

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        for name in ("timeout_s", "deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def rules(self) -> SourceRules:
        return SourceRules(tuple(str(root) for root in self.roots), self.allowed_hosts, self.allowed_s3_buckets,
                           self.allowed_s3_endpoints)


@dataclass(frozen=True)
class ResolvedSource:
    path: Path  # a local adapter directory, confined and checked
    source: str  # what the caller asked for
    sha256: str | None  # the digest that was verified, when one was given


# The flag of each contract rule, named in refusals.
RULE_FLAGS = {"roots": "--adapter-root", "url_hosts": "--adapter-url-host", "s3_buckets": "--adapter-s3-bucket",
              "s3_endpoints": "--adapter-s3-endpoint"}
# A path that is not there (yet) may be copied later; every other refusal stands until the request changes.
TRANSIENT_CODES = frozenset({"path_not_found"})


def _refuse(message: str, code: str = "path_not_allowed") -> AdapterSourceError:
    return AdapterSourceError(message, param="lora_path", code=code, is_transient=code in TRANSIENT_CODES)


def check_load_source(config: SourceConfig, source: str, *, auth_token: str | None = None,
                      s3: S3Access | None = None) -> Source:
    """The engine's check of a load's source before any file is read or fetched: the request's credentials
    fit its kind, and the contract's rules (`kubelora.contract.sources`) allow it."""
    kind = source_kind(source)
    if s3 is not None and kind is not SourceKind.S3:
        raise _refuse("s3 settings are for s3:// sources only", "unsupported_scheme")
    if auth_token is not None and kind is SourceKind.S3:
        raise _refuse("auth_token is for http(s) sources; s3:// sources take s3 credentials", "unsupported_scheme")
    try:
        return check_source(config.rules, source, s3_endpoint=s3.endpoint if s3 is not None else None)
    except SourceNotAllowed as exc:
        if exc.rule is None:
            raise
        raise SourceNotAllowed(f"{exc.message} ({RULE_FLAGS[exc.rule]})", code=exc.code or "", rule=exc.rule,
                               param=exc.param or "lora_path") from None


def resolve_source(config: SourceConfig, source: str, sha256: str | None = None, *,
                   auth_token: str | None = None, s3: S3Access | None = None) -> ResolvedSource:
    """auth_token: sent as a bearer token to an http(s) source's host (not across redirects to another host);
    s3: endpoint, region and key pair of an s3:// source (None: the default credential chain)."""
    checked = check_load_source(config, source, auth_token=auth_token, s3=s3)
    if checked.kind is SourceKind.URL:
        return ResolvedSource(fetch_url(config, source, sha256, auth_token), source, sha256)
    if checked.kind is SourceKind.S3:
        return ResolvedSource(fetch_s3(config, checked, sha256, s3 or S3Access()), source, sha256)
    path = confine_local(config.roots, source)
    if sha256 is not None:
        _check_digest(_file_sha256(path / WEIGHTS_FILE), sha256, WEIGHTS_FILE)
    return ResolvedSource(path, source, sha256)


def confine_local(roots: tuple[Path, ...], source: str) -> Path:
    """The resolved adapter directory, or AdapterSourceError when it (or a file in it) leaves every root.

    The contract's lexical check first; then symlinks are resolved, which only this side can do."""
    text = check_local(tuple(str(root) for root in roots), source)
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    candidates = [Path(text)] if Path(text).is_absolute() else [root / text for root in real_roots]
    for candidate in candidates:
        real = Path(os.path.realpath(candidate))
        root = next((r for r in real_roots if real.is_relative_to(r)), None)
        if root is None:
            continue
        if real.exists() and not real.is_dir():  # a file, say the weights file named instead of its folder
            raise _refuse(f"lora_path {source!r} is a file, not an adapter directory", "path_not_directory")
        if not real.is_dir():
            raise _refuse(f"lora_path {source!r} is not a directory", "path_not_found")
        _check_tree_confined(real, root, source)
        return real
    shown = ", ".join(str(r) for r in roots)
    raise _refuse(f"lora_path {source!r} resolves outside the adapter roots ({shown})")


def _check_tree_confined(directory: Path, root: Path, source: str) -> None:
    """A symlinked file inside a confined directory could still point anywhere: check every entry."""
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        for name in dirnames + filenames:
            entry = Path(dirpath) / name
            if entry.is_symlink() and not Path(os.path.realpath(entry)).is_relative_to(root):
                raise _refuse(f"lora_path {source!r} holds {name!r}, a link out of the adapter roots")


def fetch_url(config: SourceConfig, url: str, sha256: str | None, auth_token: str | None = None) -> Path:
    """Download an archive, or the two adapter files under a URL "directory"; return the local directory."""
    check_url(config.allowed_hosts, url)  # resolve_source checked it too; fetch_url may be called alone

    def get_for(deadline_at: float) -> Get:
        def get(file_url: str, dest: Path) -> str:
            return download(file_url, dest, max_bytes=config.max_bytes, timeout_s=config.timeout_s,
                            deadline_s=deadline_at - time.monotonic(), total_deadline_s=config.deadline_s,
                            is_allowed=lambda target: host_allowed(config.allowed_hosts, target),
                            auth_token=auth_token)
        return get

    return _fetch_cached(config, url, url, sha256, get_for)


def fetch_s3(config: SourceConfig, source: Source, sha256: str | None, access: S3Access) -> Path:
    """As fetch_url, for an s3:// archive object or prefix (`source` as `check_load_source` returned it): each
    object through a presigned GET (s3.py)."""

    def get_for(deadline_at: float) -> Get:
        def get(object_url: str, dest: Path) -> str:
            obj = S3Object(source.bucket, urllib.parse.urlsplit(object_url).path.lstrip("/"))
            signed = sign_get(obj, access, timeout_s=min(config.timeout_s, max(deadline_at - time.monotonic(), 1)))
            signing_host = urllib.parse.urlsplit(signed).netloc
            return download(signed, dest, max_bytes=config.max_bytes, timeout_s=config.timeout_s,
                            deadline_s=deadline_at - time.monotonic(), total_deadline_s=config.deadline_s,
                            is_allowed=lambda target: urllib.parse.urlsplit(target).netloc == signing_host,
                            shown=f"s3://{obj.bucket}/{obj.key}")
        return get

    # Another endpoint holding the same bucket and key is another artifact.
    return _fetch_cached(config, source.text, f"{access.endpoint or ''} {source.text}", sha256, get_for)


def _fetch_cached(config: SourceConfig, source: str, cache_key: str, sha256: str | None,
                  get_for: Callable[[float], Get]) -> Path:
    """Fetch `source` (an archive, or a "directory" of the adapter files) through `get_for(deadline)`.

    Downloads land in `cache_dir/<cache key digest>/<content digest>`, so the same bytes always give the same
    directory (the engine sees one revision), and a changed artifact behind the same source gives a new one.
    """
    # The staging directory is shared by every source, so that a failed download leaves nothing behind.
    staging_root = config.cache_dir / ".staging"
    staging_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="download-", dir=staging_root))
    get = get_for(time.monotonic() + config.deadline_s)  # for the whole adapter: one file or two, redirects too
    try:
        is_archive = urllib.parse.urlsplit(source).path.lower().endswith(ARCHIVE_SUFFIXES)
        digest = (_fetch_archive if is_archive else _fetch_files)(config, source, staging, sha256, get)
        source_dir = config.cache_dir / hashlib.sha256(cache_key.encode()).hexdigest()[:24]
        source_dir.mkdir(exist_ok=True)
        final = source_dir / digest[:32]
        try:
            os.rename(staging / "content", final)
        except OSError:
            if not final.is_dir():  # else a concurrent fetch of the same bytes won the rename
                raise
        return find_adapter_dir(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


Get = Callable[[str, Path], str]  # (url, destination file) -> the sha256 of what was written


def _fetch_archive(config: SourceConfig, url: str, staging: Path, sha256: str | None, get: Get) -> str:
    archive = staging / "archive"
    digest = get(url, archive)
    if sha256 is not None:
        _check_digest(digest, sha256, "archive")
    extract_archive(archive, urllib.parse.urlsplit(url).path, staging / "content", max_bytes=config.max_bytes)
    return digest


def _fetch_files(config: SourceConfig, url: str, staging: Path, sha256: str | None, get: Get) -> str:
    content = staging / "content"
    content.mkdir()
    base = url.rstrip("/") + "/"
    combined = hashlib.sha256()
    for name in ADAPTER_FILES:
        digest = get(base + name, content / name)
        if name == WEIGHTS_FILE and sha256 is not None:
            _check_digest(digest, sha256, WEIGHTS_FILE)
        combined.update(digest.encode())
    return combined.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as exc:
        raise _refuse(f"cannot read {path.name} to check sha256: {exc.strerror}", "path_not_found") from None
    return h.hexdigest()


def _check_digest(actual: str, expected: str, what: str) -> None:
    if actual != expected.lower():
        raise AdapterSourceError(f"sha256 of {what} is {actual}, expected {expected.lower()}", param="sha256",
                                 code="sha256_mismatch")
