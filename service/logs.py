"""Log output: ``text`` for a terminal, ``json`` (one object per line) for journald, launchd
and other collectors. The engine process is told which one the server uses, and follows it.

A JSON line has ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``, then the fields a
call passed as ``extra`` (the request log's method, path, status, ms, task id) and ``exc``
for a traceback. Nothing logs request bodies: no prompt text reaches the log by default.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
ENV = "LMSPD_LOG_FORMAT"
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"

# What every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.static = static or {}  # fields on every line (the engine's process name)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return msgspec.json.encode(line, enc_hook=str).decode()


def default_format() -> LogFormat:
    fmt = os.environ.get(ENV, "text")
    return "json" if fmt == "json" else "text"


def formatter(fmt: LogFormat, text: str = TEXT, static: dict[str, Any] | None = None) -> logging.Formatter:
    return JsonFormatter(static) if fmt == "json" else logging.Formatter(text)


def setup(fmt: LogFormat, level: int, *, text: str = TEXT, static: dict[str, Any] | None = None) -> None:
    """The root logger writes to stderr in ``fmt`` (replacing any handler it had)."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt, text, static))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def current_format() -> LogFormat:
    """The format the root logger writes in (what the engine process is told to use)."""
    root = logging.getLogger()
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in root.handlers) else "text"
