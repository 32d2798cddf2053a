r"""Process logging of both services: `text` or `json` lines on stderr, each carrying its request id.

A record is about a request when it has a `request_id` attribute: given explicitly
(`log.info(..., extra=request_extra(rid))`, as the engine's step thread does) or taken from
`current_request_id`, the context variable the request's own task sets (the gateway's middleware, the
engine's servicer). The text format appends ` request_id=<id>`; the JSON format has a `request_id` field.
The gateway's lines also carry the id the client sent in X-Request-Id, if any (` client_request_id=<id>`,
from `current_client_request_id`).

A line is one record, whatever its arguments hold: the text format escapes every control character of
the message and of the ids (a newline is written `\n`, the others `\xHH` or `\uHHHH`), so a client's or
an admin's value (a `user` field, a model name, a node address) cannot write a line of its own; a
traceback's lines are indented under their record. The JSON format escapes them inside its string
values (json.dumps does C0; C1 and the Unicode line separators are escaped here too). uvicorn's access
lines lose their query string (a key sent as `?api_key=` must not reach the log).

Prompt and completion text is never logged here: each service logs it only under its own --log-prompts.
"""

from __future__ import annotations

import json
import logging
import re
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

# C0 controls, DEL, C1 controls and the Unicode line/paragraph separators: what can end or fake a line.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# What json.dumps(ensure_ascii=False) leaves raw of those (it escapes C0 itself).
_JSON_RAW = re.compile("[\x7f-\x9f\u2028\u2029]")
_ACCESS_LOGGER = "uvicorn.access"
REDACTED_QUERY = "?[query redacted]"


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def escape_controls(text: str) -> str:
    """`text` with every control character (and U+2028/U+2029) written as a visible escape."""
    return _CONTROLS.sub(_escape_one, text)


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


class AccessQueryFilter(logging.Filter):
    """Drops the query string from uvicorn's access lines: it can carry a key (`?api_key=...`) or any
    other secret a client put in the URL; the path stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.name == _ACCESS_LOGGER and isinstance(args, tuple) and len(args) >= 3:
            path = args[2]
            if isinstance(path, str) and "?" in path:
                record.args = (*args[:2], path.partition("?")[0] + REDACTED_QUERY, *args[3:])
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
    lines about a request; control characters escaped, so one record is one line (a traceback's lines
    follow it, indented)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = escape_controls(self.formatMessage(record))
        for name, value in _ids(record):
            line += f" {name}={escape_controls(value)}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for text in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if text:  # each line of a traceback indented: none can pass for a record of its own
                line += "".join(f"\n    {escape_controls(piece)}" for piece in text.splitlines())
        return line


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
        return _JSON_RAW.sub(
            lambda match: f"\\u{ord(match.group()):04x}", json.dumps(entry, ensure_ascii=False)
        )


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
    handler.addFilter(AccessQueryFilter())
    if prefix is not None:
        handler.addFilter(_Prefix(prefix))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
