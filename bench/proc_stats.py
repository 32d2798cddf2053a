"""What /proc says of a process: its CPU-seconds (all threads, user + system) and its resident memory."""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(*pids: int) -> float:
    """utime + stime of `pids`, summed (a process gone since counts 0)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


def rss_mib(pid: int) -> float:
    """VmRSS of `pid`, MiB (nan when /proc does not say)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
