"""Process logging of both services: `text` or `json` lines on stderr, each carrying its request id.

A record is about a request when it has a `request_id` attribute: given explicitly
(`log.info(..., extra=request_extra(rid))`, as the engine's step thread does) or taken from
`current_request_id`, the context variable the request's own task sets (the gateway's middleware, the
engine's servicer). The text format appends ` request_id=<id>`; the JSON format has a `request_id` field.
The gateway's lines also carry the id the client sent in X-Request-Id, if any (` client_request_id=<id>`,
from `current_client_request_id`).

Prompt and completion text is never logged here: each service logs it only under its own --log-prompts.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The request the current task is serving (None outside a request).
current_request_id: ContextVar[str | None] = ContextVar("conduit_request_id", default=None)
# The id the client gave the current request (the gateway's X-Request-Id), None when it gave none.
current_client_request_id: ContextVar[str | None] = ContextVar("conduit_client_request_id", default=None)


def request_extra(request_id: str) -> dict[str, str]:
    """`extra=` of a log call about `request_id` made outside the request's task (the engine thread)."""
    return {"request_id": request_id}


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` and a `client_request_id` attribute: its own, the current
    task's, or None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id.get()
        if getattr(record, "client_request_id", None) is None:
            record.client_request_id = current_client_request_id.get()
        return True


def _ids(record: logging.LogRecord) -> list[tuple[str, str]]:
    """The record's (name, id) pairs to show: the request's id, then the client's."""
    pairs = []
    for name in ("request_id", "client_request_id"):
        value = getattr(record, name, None)
        if value is not None:
            pairs.append((name, str(value)))
    return pairs


class TextFormatter(logging.Formatter):
    """The classic one-line format, with ` request_id=<id>` (and ` client_request_id=<id>`) at the end of
    lines about a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return line + "".join(f" {name}={value}" for name, value in _ids(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id (and
    client_request_id) when about a request, and the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_ids(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _Prefix(logging.Filter):
    """Starts every message with a fixed prefix (a worker process's `worker rank N: `)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = f"{self.prefix}{record.msg}"
        return True


def configure(level: str, log_format: str = "text", prefix: str | None = None) -> None:
    """Send every logger's records (uvicorn's too, given log_config=None) to stderr in `log_format`;
    `prefix` starts every message (a worker process marks its lines with its rank)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be text or json, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    if prefix is not None:
        handler.addFilter(_Prefix(prefix))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
