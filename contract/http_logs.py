"""aiohttp's log records of malformed requests, without the request's bytes.

When its HTTP parser refuses a request (a control character in a header value, a header line over 8 KiB, a bad
request line), aiohttp answers 400 and logs the parser's exception on `aiohttp.server` with its traceback. The
exception's text quotes the offending bytes: an `Authorization` header with a stray control character would put
the admin token or a tenant's API key into the log. A filter on aiohttp's loggers rewrites every record whose
exception (or one it was raised from) is a parser error: the record keeps aiohttp's message (the client's address)
and names the error's class and status, and loses the exception, its text and its traceback. The server and the
router both install it (no torch here: the router imports it).
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

AIOHTTP_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.internal")


class RedactParserErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = _parser_error(record.exc_info[1] if record.exc_info else None)
        if error is not None:
            record.msg = f"{record.getMessage()}: {type(error).__name__} (HTTP {error.code}); the request's bytes " \
                         "are not logged, they may hold credentials"
            record.args = None
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def _parser_error(exc: BaseException | None) -> HttpProcessingError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, HttpProcessingError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


_FILTER = RedactParserErrors()


def redact_aiohttp_logs() -> None:
    """Install the filter on aiohttp's loggers (once; calling again changes nothing)."""
    for name in AIOHTTP_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
