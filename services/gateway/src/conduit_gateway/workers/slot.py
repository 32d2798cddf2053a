"""Which worker a gateway process is, and where the files its siblings share with it are."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Worker `index` of `count`; `directory` is the supervisor's scratch directory."""

    index: int
    count: int
    directory: str

    @property
    def limits_path(self) -> str:
        """The keys' limit states (keys/shared_limits.py)."""
        return os.path.join(self.directory, "key-limits")

    @property
    def admin_log_path(self) -> str:
        """The admin API's changes to the pool, in order (workers/admin_log.py)."""
        return os.path.join(self.directory, "admin.log")

    def ready_path(self, index: int) -> str:
        """Made once worker `index` has started serving (any incarnation of it)."""
        return os.path.join(self.directory, f"ready-{index}")

    def mark_ready(self) -> None:
        with open(self.ready_path(self.index), "w"):
            pass

    def metrics_socket(self, index: int) -> str:
        """Where worker `index` answers its siblings' scrapes (workers/metrics_peers.py)."""
        return os.path.join(self.directory, f"metrics-{index}.sock")
