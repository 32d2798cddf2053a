"""Logging of the engine process and of its worker processes: conduit_common.logs in --log-format and
--log-level, and with json no progress bars (the weights' loading bar), so stderr stays one JSON object
per line. A worker marks each of its messages with its rank."""

from __future__ import annotations

import logging

from conduit_common import logs


class _RankPrefix(logging.Filter):
    """Starts every message of a worker process with `worker rank N: `."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"worker rank {rank}: "

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = f"{self.prefix}{record.msg}"
        return True


def configure_logging(level: str, log_format: str, worker_rank: int | None = None) -> None:
    """This process's logging; `worker_rank` set: a worker process's."""
    logs.configure(level, log_format)
    if worker_rank is not None:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_RankPrefix(worker_rank))
    if log_format == "json":
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
