"""tests/support/processes.py: child processes stop (SIGTERM, then SIGKILL), report their output and exit."""

from __future__ import annotations

import signal
import sys

import pytest

from tests.support.processes import ManagedProcess, ProcessStartError, free_port

pytestmark = pytest.mark.integration


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored():
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)"
    )
    process = ManagedProcess("stubborn", [sys.executable, "-c", code], free_port())
    process.wait_ready(lambda: "up" in process.output_tail(), timeout_s=30)
    assert process.stop(grace_s=0.5) == -signal.SIGKILL


def test_wait_ready_reports_exit_and_output():
    process = ManagedProcess(
        "failing", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], free_port()
    )
    with pytest.raises(ProcessStartError, match=r"(?s)exited with code 3.*bad flag"):
        process.wait_ready(lambda: False, timeout_s=30)
    process.stop()


def test_context_manager_stops_the_process():
    with ManagedProcess(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], free_port()
    ) as process:
        assert process.process.poll() is None
    assert process.process.returncode == -signal.SIGTERM


def test_output_tail_after_stop():
    proc = ManagedProcess("echo", [sys.executable, "-c", "print('hello from the child')"], port=0)
    proc.process.wait(timeout=30)
    proc.stop()
    assert "hello from the child" in proc.output_tail()
