"""One bounded HTTP(S) download into a file, hashed while it streams; blocking (run it in an executor).

Bounded three ways: `max_bytes`, `timeout_s` per socket read, and `deadline_s` for the whole download
(connects, redirects, headers and body). A per-read timeout alone lets a source that sends one byte every few
seconds hold a worker for as long as it likes; at the deadline every socket of the download is shut down, which
wakes the blocked read. A body shorter than its Content-Length is refused (urllib would return it as if
complete). Redirects are followed only to URLs `is_allowed` accepts: an allowed host must not bounce the engine
to an arbitrary one. An error answer's S3-style `<Code>` (AccessDenied, NoSuchKey...) is added to the message.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kubelora.contract.errors import AdapterSourceError
from kubelora.engine.server.source_text import redact_source

CHUNK_BYTES = 1 << 20


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, is_allowed: Callable[[str], bool]) -> None:
        self._is_allowed = is_allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401 - urllib's hook
        if not self._is_allowed(newurl):
            raise AdapterSourceError("adapter download redirected to a host that is not allowed: "
                                     f"{redact_source(newurl)}", param="lora_path", code="url_not_allowed")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")  # the source's credentials are for its own host only
        return new


class _Deadline:
    """Shuts down every socket opened through `wrap`ped connections once `seconds` have passed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.is_expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def wrap(self, connection_class: type[http.client.HTTPConnection]) -> Callable[..., http.client.HTTPConnection]:
        def make(*args, **kwargs) -> http.client.HTTPConnection:
            connection = connection_class(*args, **kwargs)
            # http.client opens its socket (HTTPS: before wrapping it in TLS) through this attribute.
            connection._create_connection = self._connect
            return connection
        return make

    def cancel(self) -> None:
        self._timer.cancel()

    def _connect(self, *args, **kwargs) -> socket.socket:
        sock = socket.create_connection(*args, **kwargs)
        with self._lock:
            self._sockets.append(sock)
            if self.is_expired:
                _shut(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.is_expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(self._deadline.wrap(http_class), req, **kwargs)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(self._deadline.wrap(http_class), req, **kwargs)


# HTTP answers that say "not now" rather than "never": not there yet, timeout, rate limit, server trouble.
TRANSIENT_HTTP = frozenset({404, 408, 425, 429})


def _fail(url: str, why: str, *, is_transient: bool) -> AdapterSourceError:
    """is_transient: a network failure, a deadline, a cut body or a transient HTTP status; False: the size limit,
    an HTTP status that will not change by itself (401, 403, 410, ...). `url` is shown redacted."""
    return AdapterSourceError(f"cannot download {redact_source(url)}: {why}", param="lora_path",
                              code="download_failed", is_transient=is_transient)


MAX_ERROR_BODY_BYTES = 4096
_S3_ERROR_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")


def _error_code(error: urllib.error.HTTPError) -> str:
    """' (NoSuchKey)' from an S3-style XML error body, else ""; reads at most MAX_ERROR_BODY_BYTES."""
    try:
        match = _S3_ERROR_CODE.search(error.read(MAX_ERROR_BODY_BYTES) or b"")
    except (OSError, http.client.HTTPException):
        return ""
    return f" ({match.group(1).decode()})" if match else ""


def is_transient_http(status: int) -> bool:
    return status in TRANSIENT_HTTP or status >= 500


def download(url: str, dest: Path, *, max_bytes: int, timeout_s: float, deadline_s: float,
             is_allowed: Callable[[str], bool], auth_token: str | None = None,
             total_deadline_s: float | None = None, shown: str | None = None) -> str:
    """Write the body of `url` to `dest`; return its sha256 hex digest. auth_token: a bearer token for url's host.

    deadline_s: the seconds left for this download; total_deadline_s: the deadline its error names (the whole
    adapter's, when this is one of its files); shown: what errors name instead of the redacted `url` (the
    s3:// object a presigned URL stands for)."""
    named = shown or url
    late = f"it did not finish within the {total_deadline_s or deadline_s:g} s deadline of the adapter download"
    if deadline_s <= 0:
        raise _fail(named, late, is_transient=True)
    deadline = _Deadline(deadline_s)
    opener = urllib.request.build_opener(_CheckedRedirects(is_allowed), _HTTPHandler(deadline),
                                         _HTTPSHandler(deadline))
    headers = {"User-Agent": "kubelora-engine"}
    if auth_token is not None:
        headers["Authorization"] = f"Bearer {auth_token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with opener.open(request, timeout=min(timeout_s, deadline_s)) as response:
            digest = _copy(named, response, dest, max_bytes)
    except urllib.error.HTTPError as exc:
        raise _fail(named, f"HTTP {exc.code} {exc.reason}{_error_code(exc)}",
                    is_transient=is_transient_http(exc.code)) from None
    except (AdapterSourceError, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        if deadline.is_expired:
            raise _fail(named, late, is_transient=True) from None
        if isinstance(exc, AdapterSourceError):
            raise
        raise _fail(named, str(getattr(exc, "reason", exc)) or type(exc).__name__, is_transient=True) from None
    finally:
        deadline.cancel()
    if deadline.is_expired:  # the shut-down socket reads as the end of a body that has no length
        raise _fail(named, late, is_transient=True)
    return digest


def _copy(url: str, response: http.client.HTTPResponse, dest: Path, max_bytes: int) -> str:
    declared = response.headers.get("Content-Length")
    length = int(declared) if declared is not None and declared.isdigit() else None
    if length is not None and length > max_bytes:
        raise _fail(url, f"{length} bytes is more than the limit of {max_bytes}", is_transient=False)
    digest = hashlib.sha256()
    written = 0
    with open(dest, "wb") as out:
        while block := response.read(CHUNK_BYTES):
            written += len(block)
            if written > max_bytes:
                raise _fail(url, f"more than the limit of {max_bytes} bytes", is_transient=False)
            digest.update(block)
            out.write(block)
    if length is not None and written != length:
        raise _fail(url, f"the body ended after {written} of the {length} bytes its Content-Length announced",
                    is_transient=True)
    return digest.hexdigest()
