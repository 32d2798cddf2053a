"""Process trees from /proc (Linux): a process's descendants, and whether a pid still runs.

For tests that check no child outlives its parent (tensor-parallel workers): a zombie counts as gone,
since it holds no memory and runs nothing (it waits only for its parent, or init, to reap it).
"""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's), or [] when it is gone."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children."""
    found: list[int] = []
    pending = children(pid)
    while pending:
        child = pending.pop(0)
        found.append(child)
        pending += children(child)
    return found


def is_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "zombie" not in state


def command_line(pid: int) -> str:
    """The process's arguments joined by spaces ('' when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""
