"""The reference engine's HTTP server log: malformed requests are counted, not tracebacks.

aiohttp answers a request it cannot parse (garbage bytes, a bad header, a bad
chunk) with 400 and logs it at ERROR with the parser's traceback, through the
logger its request handler is given. :class:`HttpServerLog` is that logger for
the engine's port (``web.AppRunner(..., logger=...)``): a malformed request is
one rate-limited WARNING line naming the peer and the parser's message; every
other record (an unexpected exception in a handler) passes through unchanged.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

from atom_kv._ratelimit import RateLimitedLog

__all__ = ["HttpServerLog"]


class HttpServerLog(logging.LoggerAdapter):
    """Owns the counts of malformed requests on one HTTP port (``bad_requests``) and their log lines."""

    def __init__(self, logger: logging.Logger, log_interval_s: float = 10.0) -> None:
        super().__init__(logger, {})
        self.bad_requests = 0
        self._bad = RateLimitedLog(logger, "malformed HTTP requests", interval_s=log_interval_s)

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            self.bad_requests += 1
            peer = args[0] if args else "?"
            self._bad.event("parse", f"malformed HTTP request from {peer} answered 400: "
                                     f"{(exc.message or type(exc).__name__)[:200]}")
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)
