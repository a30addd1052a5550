"""One bounded HTTP(S) download into a file, hashed while it streams; blocking (run it in an executor).

Redirects are followed only to URLs `is_allowed` accepts: an allowed host must not bounce the engine to an
arbitrary one.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kubelora.engine.common.errors import AdapterSourceError

CHUNK_BYTES = 1 << 20


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, is_allowed: Callable[[str], bool]) -> None:
        self._is_allowed = is_allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401 - urllib's hook
        if not self._is_allowed(newurl):
            raise AdapterSourceError(f"adapter download redirected to a host that is not allowed: {newurl}",
                                     param="lora_path", code="url_not_allowed")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")  # the source's credentials are for its own host only
        return new


def _fail(url: str, why: str) -> AdapterSourceError:
    return AdapterSourceError(f"cannot download {url}: {why}", param="lora_path", code="download_failed")


def download(url: str, dest: Path, *, max_bytes: int, timeout_s: float, is_allowed: Callable[[str], bool],
             auth_token: str | None = None) -> str:
    """Write the body of `url` to `dest`; return its sha256 hex digest. auth_token: a bearer token for url's host."""
    opener = urllib.request.build_opener(_CheckedRedirects(is_allowed))
    digest = hashlib.sha256()
    written = 0
    headers = {"User-Agent": "kubelora-engine"}
    if auth_token is not None:
        headers["Authorization"] = f"Bearer {auth_token}"
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response, \
                open(dest, "wb") as out:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise _fail(url, f"{declared} bytes is more than the limit of {max_bytes}")
            while block := response.read(CHUNK_BYTES):
                written += len(block)
                if written > max_bytes:
                    raise _fail(url, f"more than the limit of {max_bytes} bytes")
                digest.update(block)
                out.write(block)
    except urllib.error.HTTPError as exc:
        raise _fail(url, f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise _fail(url, str(getattr(exc, "reason", exc))) from None
    return digest.hexdigest()
