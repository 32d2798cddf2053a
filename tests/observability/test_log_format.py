"""conduit_common.logs: the text and JSON line formats and where a line's request id comes from."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from conduit_common import logs

pytestmark = pytest.mark.unit


def _record(message: str = "request %s queued", *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "conduit_engine.engine.llm_engine", logging.INFO, __file__, 1, message, args, None
    )
    record.__dict__.update(extra)
    logs.RequestIdFilter().filter(record)
    return record


def test_json_lines_carry_the_request_id_given_with_the_record():
    line = logs.JsonFormatter().format(_record("request %s queued", "r-1", request_id="r-1"))
    entry = json.loads(line)
    assert entry["message"] == "request r-1 queued"
    assert (entry["level"], entry["logger"], entry["request_id"]) == (
        "INFO",
        "conduit_engine.engine.llm_engine",
        "r-1",
    )
    assert entry["time"].endswith("+00:00")


def test_the_current_tasks_request_id_fills_lines_that_give_none():
    token = logs.current_request_id.set("r-task")
    try:
        record = _record("stream failed")
    finally:
        logs.current_request_id.reset(token)
    assert json.loads(logs.JsonFormatter().format(record))["request_id"] == "r-task"
    assert logs.TextFormatter().format(record).endswith("stream failed request_id=r-task")


def test_lines_about_no_request_have_no_request_id():
    record = _record("SERVING %s", "m")
    assert "request_id" not in json.loads(logs.JsonFormatter().format(record))
    assert logs.TextFormatter().format(record).endswith("SERVING m")


def test_exceptions_stay_inside_the_json_line():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    assert "RuntimeError: boom" in json.loads(line)["exception"]


def test_configure_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="--log-format must be text or json"):
        logs.configure("INFO", "yaml")


FORGED = "2026-01-01 00:00:00,000 INFO conduit_gateway.http.admin: admin key rotated"


@pytest.mark.parametrize(
    ("raw", "escaped"),
    [
        ("a\nb", "a\\nb"),
        ("a\r\nb", "a\\r\\nb"),
        ("a\tb", "a\\tb"),
        ("a\x1b[31mb", "a\\x1b[31mb"),
        ("a\x00b\x7f", "a\\x00b\\x7f"),
        ("a\x85b", "a\\x85b"),
        ("a\u2028b\u2029", "a\\u2028b\\u2029"),
        ("plain é ü 中文", "plain é ü 中文"),
    ],
)
def test_text_lines_escape_control_characters_of_the_message(raw, escaped):
    line = logs.TextFormatter().format(_record("user=%s done", raw))
    assert line.endswith(f"user={escaped} done")
    assert len(line.splitlines()) == 1


def test_a_value_with_a_newline_cannot_write_a_line_of_its_own():
    line = logs.TextFormatter().format(
        _record("request r: user=%s", "u\n" + FORGED, request_id="r\n" + FORGED)
    )
    assert line.splitlines() == [line]
    assert line.count(FORGED) == 2 and "\\n" + FORGED in line


def test_a_traceback_stays_under_its_record_even_when_its_message_has_newlines():
    try:
        raise ValueError("bad model name\n" + FORGED)
    except ValueError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    first, *rest = logs.TextFormatter().format(record).splitlines()
    assert first.endswith("failed") and rest
    assert all(line.startswith("    ") for line in rest)
    assert any(FORGED in line for line in rest)


def test_json_lines_escape_c1_controls_and_line_separators():
    line = logs.JsonFormatter().format(_record("user=%s", "a\x85b\u2028c\nd"))
    assert line.splitlines() == [line]  # str.splitlines splits at \x85 and \u2028 too
    assert json.loads(line)["message"] == "user=a\x85b\u2028c\nd"


def test_access_lines_lose_their_query_string():
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/v1/models?api_key=sk-secret-1&x=2", "1.1", 401),
        None,
    )
    logs.AccessQueryFilter().filter(record)
    assert record.getMessage() == '127.0.0.1:5000 - "GET /v1/models?[query redacted] HTTP/1.1" 401'
    plain = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "%s %s %s", ("a", "b", "/p"), None)
    logs.AccessQueryFilter().filter(plain)
    assert plain.getMessage() == "a b /p"
