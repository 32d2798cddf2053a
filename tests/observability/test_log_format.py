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
