"""Log lines for people or for log shippers: ``--log-format text`` (the default) or ``json``.

:func:`configure_logging` is what the proxy's and the reference engine's
command lines call once, at start (a TP rank process calls it too, with the
format its engine uses: :func:`root_format`). In ``json`` mode every record is
one JSON object on one line (what Loki, Elastic or Cloud Logging read):

- ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``msg``;
- ``request_id``, ``engine`` and ``instance`` when the line was logged where
  one is known, and the fields a process gives (a TP rank's ``tp_rank``);
- ``exc``: an exception's traceback, JSON-escaped, so still one line.

Warnings, and exceptions no thread caught, go through logging too, so nothing
writes a multi-line traceback between the JSON lines.

The request id, engine and instance come from context variables, set where
they are known: the proxy sets :data:`REQUEST_ID` in each exchange's own task
(:mod:`atom_kv.proxy.relay.fastpath`; the legs' tasks inherit it), the
engine's HTTP server for each request, an engine core's loop thread
:data:`ENGINE`, a health probe's task :data:`INSTANCE`. A log call's
``extra={"instance": ...}`` wins over the variable. A variable's value is the
context's (a task's, a thread's), so two engines in one process do not mix.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from contextvars import ContextVar
from typing import Any, Mapping, Optional, Union

import msgspec

__all__ = ["LOG_FORMATS", "TEXT_FORMAT", "REQUEST_ID", "ENGINE", "INSTANCE", "ContextFilter", "JsonFormatter",
           "configure_logging", "root_format", "add_log_format_argument"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: the request being served in this context (the proxy's ``X-Request-Id``, or the id it made up)
REQUEST_ID: ContextVar[Optional[str]] = ContextVar("atom_kv_request_id", default=None)
#: the engine this context works for (a reference engine's ``engine_id``)
ENGINE: ContextVar[Optional[str]] = ContextVar("atom_kv_engine", default=None)
#: the upstream instance this context works on (the proxy's view of an engine: its URL)
INSTANCE: ContextVar[Optional[str]] = ContextVar("atom_kv_instance", default=None)

_CONTEXT = (("request_id", REQUEST_ID), ("engine", ENGINE), ("instance", INSTANCE))


class ContextFilter(logging.Filter):
    """Stamps each record with the request id, engine and instance of the context it was logged in
    (unless the call gave its own with ``extra=``). Runs in the logging call's thread and task."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = record.__dict__
        for name, var in _CONTEXT:
            if fields.get(name) is None:
                value = var.get()
                if value is not None:
                    fields[name] = value
        return True


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON: ``ts``, ``level``, ``logger``, ``msg``, then the context
    fields that are set, this process's ``fields``, and ``exc``/``stack`` (escaped, one line)."""

    def __init__(self, fields: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__()
        self._fields = dict(fields or {})
        self._encoder = msgspec.json.Encoder(enc_hook=str)  # an odd value in extra= is logged as its str()
        self._second = -1  # the last whole second formatted, and its text (one strftime per second)
        self._second_text = ""

    def _timestamp(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        return f"{self._second_text}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": self._timestamp(record), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage()}
        fields = record.__dict__
        for name, _ in _CONTEXT:
            value = fields.get(name)
            if value is not None:
                out[name] = value
        out.update(self._fields)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return self._encoder.encode(out).decode("utf-8")


def _log_format(text: str) -> str:
    """``--log-format``'s argparse type: its own one-line refusal."""
    if text not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"must be text or json, got {text!r}")
    return text


def add_log_format_argument(parser: argparse.ArgumentParser) -> None:
    """``--log-format text|json`` (default text) on a command line's parser."""
    parser.add_argument("--log-format", type=_log_format, default="text", metavar="{text,json}",
                        help="text: one readable line a record (the default); json: one JSON object a line, with "
                             "ts, level, logger, msg, and request_id, engine or instance where there is one (for "
                             "log shippers)")


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("atom_kv").critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("atom_kv").error("uncaught exception in thread %s", name,
                                       exc_info=args.exc_value if args.exc_value is not None else True)


def configure_logging(level: Union[int, str], fmt: str = "text", *, text_format: str = TEXT_FORMAT,
                      fields: Optional[Mapping[str, Any]] = None) -> None:
    """Log to stderr at ``level``, as ``text`` (``text_format``) or ``json`` (:class:`JsonFormatter`, with
    ``fields`` on every line). Like :func:`logging.basicConfig`, it does nothing when the root logger has
    handlers already (a test harness's, say). In ``json`` mode warnings and uncaught exceptions (of any
    thread) are logged too, so they become JSON lines instead of raw tracebacks."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(fields))
        handler.addFilter(ContextFilter())
    else:
        handler.setFormatter(logging.Formatter(text_format))
    logging.basicConfig(level=level, handlers=[handler])
    if fmt == "json" and handler in logging.getLogger().handlers:
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def root_format() -> str:
    """The format this process logs in (``json`` when a root handler formats JSON), for its child processes."""
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers) else "text"
