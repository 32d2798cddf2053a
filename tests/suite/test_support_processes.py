"""tests/support/processes.py: child processes stop (SIGTERM, then SIGKILL), report their output and exit;
tests/support/proc_tree.py: descendants found through /proc."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.support.polling import wait_for
from tests.support.proc_tree import command_line, descendants, is_running
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


def test_descendants_lists_grandchildren_and_they_end_with_their_tree():
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('up', flush=True); time.sleep(60)"
    )
    process = ManagedProcess("tree", [sys.executable, "-c", code], free_port())
    process.wait_ready(lambda: "up" in process.output_tail(), timeout_s=30)
    wait_for(lambda: len(descendants(process.process.pid)) == 1, "the grandchild")
    (child,) = descendants(process.process.pid)
    assert is_running(child) and "time.sleep(60)" in command_line(child)
    process.stop()
    assert not is_running(process.process.pid)
    os.kill(child, signal.SIGKILL)  # its parent is gone: nothing else stops it
    wait_for(lambda: not is_running(child), "the grandchild to end")
