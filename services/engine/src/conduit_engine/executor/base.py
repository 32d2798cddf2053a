"""What the engine needs of an executor: run a step, move KV blocks, report failure, shut down.

Two implementations: `in_process.InProcessExecutor` (the model in the engine process, the default with
one device) and `multiproc.MultiprocExecutor` (the model in worker processes: --tensor-parallel-size N
or --worker-process). Plain Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from conduit_engine.core.scheduler_output import SchedulerOutput
from conduit_engine.executor.step_batch import SeqStepResult


class Executor(Protocol):
    """How a step reaches the model, in this process or in worker processes."""

    # Whether `execute` runs a step of several forward passes (SchedulerOutput.num_passes > 1).
    multi_pass: bool

    def execute(self, out: SchedulerOutput) -> list[SeqStepResult]:
        """Run one step; one result per scheduled sequence, in schedule order, with one sampled token per
        pass for each sequence that samples."""
        ...

    def gather_kv_blocks(self, block_ids: Sequence[int]) -> bytes:
        """KV of cache blocks `block_ids` (in that order) as one payload: little-endian, laid out
        [layer][k, v][block][block_size][num_kv_heads][head_dim] over all of the model's KV heads."""
        ...

    def gather_kv_blocks_into(self, block_ids: Sequence[int], out: memoryview) -> None:
        """Write that payload into `out` (writable, exactly its size: shared memory)."""
        ...

    def scatter_kv_blocks(self, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        """Write a payload of that layout into cache blocks `block_ids` (distinct)."""
        ...

    def failure(self) -> str | None:
        """Why the executor cannot run steps any more (a worker failed), or None."""
        ...

    def on_failure(self, listener: Callable[[], None]) -> None:
        """Call `listener` (from any thread) when the executor fails."""
        ...

    def shutdown(self) -> None:
        """Release the executor's processes, if any (idempotent)."""
        ...
